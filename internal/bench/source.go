package bench

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// CreateDatabase creates database name on pg and returns its URL.
func CreateDatabase(ctx context.Context, pg *testenv.Postgres, name string) (string, error) {
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return "", fmt.Errorf("connect postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return pg.URL(name), nil
}

// DropDatabase drops the database name made by CreateDatabase, with its
// replication slots (none may be active).
func DropDatabase(ctx context.Context, pg *testenv.Postgres, name string) error {
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1", name); err != nil {
		return fmt.Errorf("drop the slots of database %s: %w", name, err)
	}
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// ShopFor sizes a seed so that deleting every order removes at least rows
// rows (orders of 7 rows each by cascade, 10 orders per customer).
func ShopFor(rows int) workload.SeedConfig {
	cfg := workload.SeedConfig{OrdersPerCustomer: 10, LinesPerOrder: 3, ShipmentsPerOrder: 1, ItemsPerShipment: 2, NoLedger: true}
	per := cfg.RowsPerOrder() * cfg.OrdersPerCustomer
	cfg.Customers = (rows + per - 1) / per
	return cfg
}

// DeleteAllOrders deletes every order by cascade, perTx orders per
// transaction (one DELETE .. WHERE id = ANY), in id order.
func DeleteAllOrders(ctx context.Context, url string, perTx int) (time.Duration, error) {
	took, _, err := DeleteAllOrdersCPU(ctx, url, perTx)
	return took, err
}

// DeleteAllOrdersCPU is DeleteAllOrders that also returns the CPU seconds
// its backend spent, read from /proc before the connection closes (an
// exited backend's CPU is not reliably found in the postmaster's).
func DeleteAllOrdersCPU(ctx context.Context, url string, perTx int) (took time.Duration, cpu float64, err error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, 0, fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	pid := int(conn.PgConn().PID())
	cpu0, err := ProcCPU(pid)
	if err != nil {
		return 0, 0, err
	}
	if took, err = deleteAllOrders(ctx, conn, perTx); err != nil {
		return 0, 0, err
	}
	cpu1, err := ProcCPU(pid)
	if err != nil {
		return 0, 0, err
	}
	return took, cpu1 - cpu0, nil
}

// DeleteAllOrdersOn is DeleteAllOrders on an open connection, whose
// backend (conn.PgConn().PID()) a caller can watch while it deletes.
func DeleteAllOrdersOn(ctx context.Context, conn *pgx.Conn, perTx int) (time.Duration, error) {
	return deleteAllOrders(ctx, conn, perTx)
}

func deleteAllOrders(ctx context.Context, conn *pgx.Conn, perTx int) (time.Duration, error) {
	rows, err := conn.Query(ctx, "SELECT id FROM public.orders ORDER BY id")
	if err != nil {
		return 0, fmt.Errorf("list orders: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, fmt.Errorf("list orders: %w", err)
	}
	start := time.Now()
	for len(ids) > 0 {
		n := min(perTx, len(ids))
		if _, err := conn.Exec(ctx, "DELETE FROM public.orders WHERE id = ANY($1)", ids[:n]); err != nil {
			return 0, fmt.Errorf("delete orders: %w", err)
		}
		ids = ids[n:]
	}
	return time.Since(start), nil
}

// CaptureEnv is the environment of a capture process reading sourceURL.
// natsURL empty = embedded JetStream listening on listen with its store
// under dataDir.
func CaptureEnv(sourceURL, natsURL, listen, dataDir, metricsAddr, source, slot string) []string {
	return []string{
		"EPITAPH_SOURCE_URL=" + sourceURL,
		"EPITAPH_NATS_URL=" + natsURL,
		"EPITAPH_NATS_LISTEN=" + listen,
		"EPITAPH_DATA_DIR=" + dataDir,
		"EPITAPH_TABLES=" + strings.Join(workload.Tables, ","),
		"EPITAPH_PARTITIONS=8",
		"EPITAPH_METRICS_ADDR=" + metricsAddr,
		"EPITAPH_SOURCE_NAME=" + source,
		"EPITAPH_SLOT=" + slot,
		"EPITAPH_PUBLICATION=" + slot,
	}
}

// EmbeddedCreds authenticates as the projector role to the embedded broker
// of a capture with dataDir, reading its credentials file at each connect:
// the capture writes it before its broker listens, so a client made before
// the capture starts (retrying its connection) finds it when it gets in.
// (nats.UserCredentials would refuse the option while the file is missing.)
func EmbeddedCreds(dataDir string) nats.Option {
	path := broker.ProjectorCreds(filepath.Join(dataDir, "nats"))
	creds := nats.UserJWT(func() (string, error) {
		raw, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil // not yet: no credentials, the server refuses and the client retries
		}
		if err != nil {
			return "", fmt.Errorf("read %s: %w", path, err)
		}
		return jwt.ParseDecoratedJWT(raw)
	}, func(nonce []byte) ([]byte, error) {
		raw, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", path, err)
		}
		kp, err := jwt.ParseDecoratedNKey(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		defer kp.Wipe()
		return kp.Sign(nonce)
	})
	return func(o *nats.Options) error {
		if err := creds(o); err != nil {
			return err
		}
		return nats.CustomInboxPrefix(natsconn.InboxPrefix(broker.ProjectorUser))(o)
	}
}

// ProjectorEnv is the environment of a projector worker.
func ProjectorEnv(targetURL, natsURL, metricsAddr, source, worker string) []string {
	return []string{
		"EPITAPH_TARGET_URL=" + targetURL,
		"EPITAPH_SOURCE_URL=" + targetURL,
		"EPITAPH_NATS_URL=" + natsURL,
		"EPITAPH_METRICS_ADDR=" + metricsAddr,
		"EPITAPH_SOURCE_NAME=" + source,
		"EPITAPH_WORKER_ID=" + worker,
	}
}

// LocalAddr is a free 127.0.0.1:port.
func LocalAddr() (string, error) {
	p, err := testenv.FreePort()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("127.0.0.1:%d", p), nil
}

// TempDir makes a directory for a run's binaries, logs and stores, readable
// by the postgres user (the server may run as it).
func TempDir(prefix string) (string, error) {
	d, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", err
	}
	if err := os.Chmod(d, 0o755); err != nil {
		return "", err
	}
	return filepath.Clean(d), nil
}

// Figure prints one result line in the stable format of the benchmarks:
// "BENCH <name> <value> <unit>".
func Figure(name string, value float64, unit string) {
	fmt.Printf("BENCH %-52s %14.2f %s\n", name, value, unit)
}

// Note prints an informational line: "NOTE <text>".
func Note(format string, args ...any) {
	fmt.Printf("NOTE  "+format+"\n", args...)
}

// LoadNote prints the machine's load average and CPU count: figures taken on
// a busy machine are not comparable.
func LoadNote(when string) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return
	}
	f := strings.Fields(string(b))
	if len(f) >= 3 {
		Note("load average %s: %s %s %s on %d CPUs", when, f[0], f[1], f[2], runtime.NumCPU())
	}
}

// Load1 is the machine's 1-minute load average (0 when unknown).
func Load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

// SampleWalsender follows the CPU seconds of the walsender serving slot
// (the slot's active_pid), read from /proc every 50 ms on a connection of
// its own, until the returned function is called; that returns the last
// sample (an exited walsender's CPU is not reliably found in the
// postmaster's, so it is read while it runs: the last 50 ms of a walsender
// that ends first are missed).
func SampleWalsender(ctx context.Context, url, slot string) (func() float64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect for walsender samples: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan float64, 1)
	sample := func(pid *int) float64 {
		if *pid == 0 {
			var active *int32
			if err := conn.QueryRow(ctx, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&active); err == nil && active != nil {
				*pid = int(*active)
			}
		}
		if *pid != 0 {
			if c, err := ProcCPU(*pid); err == nil {
				return c
			}
		}
		return 0
	}
	go func() {
		defer conn.Close(context.Background())
		pid, cpu := 0, 0.0
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			cpu = max(cpu, sample(&pid))
			select {
			case <-ctx.Done():
				done <- max(cpu, sample(&pid)) // a known walsender is read once more
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	var result float64
	return func() float64 {
		once.Do(func() {
			cancel()
			result = <-done
		})
		return result
	}, nil
}
