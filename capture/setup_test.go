package capture

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func dbName(t *testing.T, dbURL string) string {
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	return strings.TrimPrefix(u.Path, "/")
}

// requireFix checks a setup error is permanent, one line, and says how to
// fix it.
func requireFix(t *testing.T, err error, parts ...string) {
	t.Helper()
	require.Error(t, err)
	require.True(t, IsPermanent(err), "permanent: %v", err)
	require.NotContains(t, err.Error(), "\n")
	for _, p := range parts {
		require.Contains(t, err.Error(), p)
	}
}

func TestServerVersionCheck(t *testing.T) {
	t.Parallel()
	requireFix(t, checkServerVersion(130011), "PostgreSQL 13.0 is too old", "14 or newer")
	requireFix(t, checkServerVersion(90624), "PostgreSQL 9.6 is too old")
	require.NoError(t, checkServerVersion(140000))
	require.NoError(t, checkServerVersion(150004))
}

func TestConfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "EPITAPH_SOURCE_URL"},
		{Config{SourceURL: "postgres://x/db"}, "EPITAPH_DATA_DIR"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", SourceName: "a.b"}, "source name"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", Partitions: -1}, "partitions"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", SlotName: "Bad-Slot"}, "slot name"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", Tables: []string{"a.b.c"}}, "schema.table"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", StreamPersist: "fast"}, "use auto, async or default"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", StreamPersist: "async", Replicas: 3}, "1-replica stream"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", StreamPersist: "async", BrokerSyncInterval: -1}, "positive --broker-sync-interval"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", DuplicateWindow: 50 * time.Millisecond}, "duplicate window must be at least 100ms (JetStream's minimum), got 50ms"},
		{Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", HeartbeatQuiet: 10 * time.Millisecond}, "heartbeat quiet time must be at least 50ms (negative: none), got 10ms"},
	} {
		_, err := New(tc.cfg)
		requireFix(t, err, tc.want)
	}
}

func TestSplitTable(t *testing.T) {
	t.Parallel()
	for in, want := range map[string][2]string{
		"orders":                   {"public", "orders"},
		"Shop.Orders":              {"shop", "orders"},
		`"My Schema"."a.b"`:        {"My Schema", "a.b"},
		` public."x""y" `:          {"public", `x"y`},
		`"weird"".name".t`:         {`weird".name`, "t"},
		"archive_v2.rows":          {"archive_v2", "rows"},
		`"Upper".lower`:            {"Upper", "lower"},
		"schema_1.table_2":         {"schema_1", "table_2"},
		`"quoted"`:                 {"public", "quoted"},
		"s.\"t with space\"":       {"s", "t with space"},
		"public.\"\u00e9t\u00e9\"": {"public", "\u00e9t\u00e9"},
	} {
		s, tb, err := splitTable(in)
		require.NoError(t, err, in)
		require.Equal(t, want, [2]string{s, tb}, in)
	}
	for _, in := range []string{"", "a.", ".b", `"open`, "a.b.c", `"a"x`} {
		_, _, err := splitTable(in)
		require.Error(t, err, in)
	}
}

func TestSetupErrors(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	norepl, owner := db+"_norepl", db+"_repl"
	e.exec(t, `CREATE TABLE owned_by_postgres (id int PRIMARY KEY);
		CREATE TABLE nokey (v int);
		CREATE SCHEMA archive_v1; CREATE TABLE archive_v1.rows (id int PRIMARY KEY);
		CREATE ROLE `+norepl+` LOGIN;
		CREATE ROLE `+owner+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+db+` TO `+owner)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+norepl+`, `+owner+` CASCADE`)
	})

	t.Run("no replication privilege", func(t *testing.T) {
		err := e.startErr(t, func(c *Config) { c.SourceURL = pg.UserURL(norepl, db) })
		requireFix(t, err, "lacks the REPLICATION privilege", `ALTER ROLE "`+norepl+`" WITH REPLICATION`)
	})
	t.Run("table not owned", func(t *testing.T) {
		err := e.startErr(t, func(c *Config) {
			c.SourceURL = pg.UserURL(owner, db)
			c.Tables = []string{"public.owned_by_postgres"}
		})
		requireFix(t, err, "must own table public.owned_by_postgres", "GRANT <owner role of")
	})
	t.Run("table does not exist", func(t *testing.T) {
		err := e.startErr(t, func(c *Config) { c.Tables = []string{"public.nope"} })
		requireFix(t, err, "table public.nope does not exist", "EPITAPH_TABLES")
	})
	t.Run("own schema named", func(t *testing.T) {
		err := e.startErr(t, func(c *Config) { c.Tables = []string{"archive_v1.rows"} })
		requireFix(t, err, "archive_v1.rows", "never publishes")
	})
	t.Run("no usable identity named", func(t *testing.T) {
		err := e.startErr(t, func(c *Config) { c.Tables = []string{"nokey"} })
		requireFix(t, err, "public.nokey has no usable replica identity", "--set-replica-identity-full")
	})
	t.Run("slot active elsewhere", func(t *testing.T) {
		e.start(t, func(c *Config) { c.Tables = []string{"owned_by_postgres"}; c.SlotName = e.slot + "_busy" })
		err := e.startErr(t, func(c *Config) {
			c.Tables = []string{"owned_by_postgres"}
			c.SlotName = e.slot + "_busy"
			c.SourceName = "second"
		})
		requireFix(t, err, "is active in process", "another --slot")
	})
	t.Run("partition count differs", func(t *testing.T) {
		svc := e.start(t, func(c *Config) {
			c.Tables = []string{"owned_by_postgres"}
			c.SlotName = e.slot + "_parts"
			c.SourceName = "parts"
		})
		require.NoError(t, svc.Stop(context.Background()))
		err := e.startErr(t, func(c *Config) {
			c.Tables = []string{"owned_by_postgres"}
			c.SlotName = e.slot + "_parts"
			c.SourceName = "parts"
			c.Partitions = 8
		})
		requireFix(t, err, "stream EPITAPH_PARTS was made with 4 partitions", "EPITAPH_PARTITIONS=4")
	})
}

func TestWalLevelNotLogical(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	require.NoError(t, pg.SetConfig("wal_level = replica"))
	require.NoError(t, pg.Restart())
	n := testenv.NewNATS(t)
	svc := newService(t, Config{SourceURL: pg.URL("postgres"), NATSURL: n.URL, DataDir: t.TempDir()})
	err := svc.Start(t.Context())
	requireFix(t, err, `wal_level is "replica"`, "ALTER SYSTEM SET wal_level = logical", "restart PostgreSQL")
	require.Error(t, svc.Wait())
}

var _ = event.StreamName
