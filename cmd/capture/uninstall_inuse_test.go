package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// `capture uninstall` without --yes is the plan: it prints the statements
// and exits 2 (docs/capture.md, the command's help), also while a capture
// still streams the slot; the plan then says the slot is in use and that
// the capture must be stopped before --yes. With --yes a slot in use is
// refused (exit 1) and nothing is dropped.
func TestUninstallPlanWhileTheSlotIsInUseExitsTwo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.orders (id int PRIMARY KEY); CREATE PUBLICATION un_pub FOR TABLE public.orders`)
	testenv.Exec(t, url, `SELECT pg_create_logical_replication_slot('un_slot', 'pgoutput')`)
	rcfg, err := pgconn.ParseConfig(url)
	require.NoError(t, err)
	rcfg.RuntimeParams["replication"] = "database"
	streamer, err := pgconn.ConnectConfig(ctx, rcfg)
	require.NoError(t, err)
	defer func() { _ = streamer.Close(context.Background()) }()
	require.NoError(t, pglogrepl.StartReplication(ctx, streamer, "un_slot", 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication, PluginArgs: []string{"proto_version '1'", "publication_names 'un_pub'"},
	}))
	count := func(q string) int {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer conn.Close(ctx)
		var n int
		require.NoError(t, conn.QueryRow(ctx, q).Scan(&n))
		return n
	}
	require.Equal(t, 1, count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'un_slot' AND active_pid IS NOT NULL`))

	vars := map[string]string{"EPITAPH_SOURCE_URL": url, "EPITAPH_SLOT": "un_slot", "EPITAPH_PUBLICATION": "un_pub"}
	stdout, stderr, code := exec(vars, "uninstall")
	require.Equal(t, 2, code, "the plan, without --yes: %s", stderr)
	require.Contains(t, stdout, `DROP PUBLICATION "un_pub";`)
	require.Contains(t, stdout, `SELECT pg_drop_replication_slot('un_slot');`)
	require.Contains(t, stdout, "in use by process")
	require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %s", stderr)
	require.Contains(t, stderr, "stop the capture")
	require.Contains(t, stderr, "--yes")

	_, stderr, code = exec(vars, "uninstall", "--yes")
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "is in use by process")
	require.Equal(t, 1, count(`SELECT count(*) FROM pg_publication WHERE pubname = 'un_pub'`), "nothing dropped while in use")
	require.Equal(t, 1, count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'un_slot'`))
}
