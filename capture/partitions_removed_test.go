package capture

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestLastPartitionDroppedIsRecordedAsATruncate: dropping the only
// partition of a published partitioned table (while the capture runs, or
// while it is stopped) takes every row out of the table without a delete;
// it is recorded as a truncate of the table like any other partition's.
func TestLastPartitionDroppedIsRecordedAsATruncate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pl (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pl_eu PARTITION OF pl FOR VALUES IN ('eu');
		CREATE TABLE pm (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pm_eu PARTITION OF pm FOR VALUES IN ('eu');
		CREATE TABLE other (id int PRIMARY KEY, v text);
		INSERT INTO pl VALUES (1, 'eu', 'a'); INSERT INTO pm VALUES (1, 'eu', 'a'); INSERT INTO other VALUES (1, 'a'), (2, 'b')`)
	start := func() *Service {
		cfg := e.config()
		fastPoll(&cfg)
		cfg.SetReplicaIdentityFull = true
		svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(testLogWriter{t}), nil))))
		require.NoError(t, err)
		require.NoError(t, svc.Start(context.Background()))
		return svc
	}
	svc := start()
	e.exec(t, `DROP TABLE pl_eu`)
	e.exec(t, `DELETE FROM other WHERE id = 1`)
	ms := e.messages(t, "main", 4)
	require.ElementsMatch(t, []string{"truncate public.pl", "commit", "delete public.other", "commit"}, ops(ms), "the drop of the last partition, while running")
	require.NoError(t, svc.Stop(context.Background()))

	e.exec(t, `DROP TABLE pm_eu`)
	svc = start()
	e.exec(t, `DELETE FROM other WHERE id = 2`)
	ms = e.messages(t, "main", 8)
	require.Equal(t, []string{"truncate public.pm", "commit", "delete public.other", "commit"}, ops(ms[4:8]), "the drop of the last partition, while stopped")
	require.NoError(t, svc.Stop(context.Background()))
}

// TestPartitionMovedToAnotherTableIsRecordedAsATruncate: a partition
// detached from one published partitioned table and attached to another
// (an archive table) took its rows out of the first without a delete, as
// a detach alone does, whether the capture was running or stopped.
func TestPartitionMovedToAnotherTableIsRecordedAsATruncate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE ev (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE ev_eu PARTITION OF ev FOR VALUES IN ('eu');
		CREATE TABLE ev_us PARTITION OF ev FOR VALUES IN ('us');
		CREATE TABLE ev_ap PARTITION OF ev FOR VALUES IN ('ap');
		CREATE TABLE ev_old (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE ev_old_x PARTITION OF ev_old FOR VALUES IN ('x');
		INSERT INTO ev VALUES (1, 'eu', 'a'), (2, 'us', 'b'), (3, 'ap', 'c'), (4, 'eu', 'd')`)
	start := func() *Service {
		cfg := e.config()
		fastPoll(&cfg)
		cfg.SetReplicaIdentityFull = true
		svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(testLogWriter{t}, nil))))
		require.NoError(t, err)
		require.NoError(t, svc.Start(context.Background()))
		return svc
	}
	svc := start()
	e.exec(t, `BEGIN; ALTER TABLE ev DETACH PARTITION ev_us; ALTER TABLE ev_old ATTACH PARTITION ev_us FOR VALUES IN ('us'); COMMIT`)
	e.exec(t, `DELETE FROM ev WHERE id = 1`)
	ms := e.messages(t, "main", 4)
	require.ElementsMatch(t, []string{"truncate public.ev", "commit", "delete public.ev", "commit"}, ops(ms), "the move, while running")
	require.NoError(t, svc.Stop(context.Background()))

	e.exec(t, `ALTER TABLE ev DETACH PARTITION ev_ap; ALTER TABLE ev_old ATTACH PARTITION ev_ap FOR VALUES IN ('ap')`)
	svc = start()
	e.exec(t, `DELETE FROM ev WHERE id = 4`)
	ms = e.messages(t, "main", 8)
	require.Equal(t, []string{"truncate public.ev", "commit", "delete public.ev", "commit"}, ops(ms[4:8]), "the move, while stopped")
	require.NoError(t, svc.Stop(context.Background()))

	// A table renamed keeps its partitions: nothing left it.
	e.exec(t, `ALTER TABLE ev RENAME TO ev_new`)
	svc = start()
	e.exec(t, `INSERT INTO ev_new VALUES (5, 'eu', 'e'); DELETE FROM ev_new`)
	ms = e.messages(t, "main", 10)
	require.Equal(t, []string{"delete public.ev_new", "commit"}, ops(ms[8:10]), "no truncate for a rename")
	require.NoError(t, svc.Stop(context.Background()))
}

// TestPartitionDroppedIsRecordedWhenTheRecordCannotBeDeletedFrom: a
// capture role granted what the other records need (SELECT, INSERT,
// UPDATE on the capture's tables) but not DELETE on the partitions'
// record still records a dropped partition as a truncate, and warns; the
// record's failure never stops the capture's catalog checks.
func TestPartitionDroppedIsRecordedWhenTheRecordCannotBeDeletedFrom(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app, capRole := db+"_app", db+"_capture"
	e.exec(t, `CREATE ROLE `+app+` LOGIN;
		GRANT CREATE ON SCHEMA public TO `+app+`;
		CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+db+` TO `+capRole+`;
		GRANT `+app+` TO `+capRole+`;
		`+sqlLeavesTable+`;
		GRANT USAGE ON SCHEMA `+stateSchema+` TO `+capRole+`;
		GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA `+stateSchema+` TO `+capRole)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+`, `+capRole+` CASCADE`)
	})
	testenv.Exec(t, pg.UserURL(app, db), `CREATE TABLE pd (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pd_eu PARTITION OF pd FOR VALUES IN ('eu');
		CREATE TABLE pd_us PARTITION OF pd FOR VALUES IN ('us');
		ALTER TABLE pd REPLICA IDENTITY FULL; ALTER TABLE pd_eu REPLICA IDENTITY FULL; ALTER TABLE pd_us REPLICA IDENTITY FULL;
		INSERT INTO pd VALUES (1, 'eu', 'a'), (2, 'us', 'b')`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SourceURL = pg.UserURL(capRole, db)
	cfg.Tables = []string{"pd"}
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	require.NoError(t, svc.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })

	testenv.Exec(t, pg.UserURL(app, db), `DROP TABLE pd_us`)
	require.Equal(t, []string{"truncate public.pd", "commit"}, ops(e.messages(t, "main", 2)), "the drop, recorded")
	require.Contains(t, logs.String(), "cannot keep the published partitions on the source")
}

// TestSubPartitionedPartitionDetachedIsRecordedAsATruncate: detaching a
// partition that is itself partitioned takes its leaves' rows out of the
// table, though the capture (every table captured) then publishes it as a
// table of its own, leaves included.
func TestSubPartitionedPartitionDetachedIsRecordedAsATruncate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE ms (id int, y int, m int, v text, PRIMARY KEY (id, y, m)) PARTITION BY LIST (y);
		CREATE TABLE ms_2024 PARTITION OF ms FOR VALUES IN (2024) PARTITION BY LIST (m);
		CREATE TABLE ms_2024_1 PARTITION OF ms_2024 FOR VALUES IN (1);
		CREATE TABLE ms_2025 PARTITION OF ms FOR VALUES IN (2025) PARTITION BY LIST (m);
		CREATE TABLE ms_2025_1 PARTITION OF ms_2025 FOR VALUES IN (1);
		INSERT INTO ms VALUES (1, 2024, 1, 'a'), (2, 2025, 1, 'b')`)
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SetReplicaIdentityFull = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(testLogWriter{t}, nil))))
	require.NoError(t, err)
	require.NoError(t, svc.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })

	e.exec(t, `ALTER TABLE ms DETACH PARTITION ms_2024`)
	e.waitPublication(t, "epitaph", "ms", "ms_2024")
	e.exec(t, `DELETE FROM ms WHERE id = 2`)
	ms := e.messages(t, "main", 4)
	require.ElementsMatch(t, []string{"truncate public.ms", "commit", "delete public.ms", "commit"}, ops(ms), "the detach")
}

// TestRecordsGrantedInPartAreWarnedOfAtStart: a capture role granted
// part of what the capture's records (made by another role) need is told
// at start that they cannot be kept, instead of failing at every write or
// read afterwards: PostgreSQL's has_table_privilege with a list of
// privileges is true when any one is held, so each is asked.
func TestRecordsGrantedInPartAreWarnedOfAtStart(t *testing.T) {
	t.Parallel()
	for name, grants := range map[string]string{
		"select and insert":         "SELECT, INSERT",
		"insert, update and delete": "INSERT, UPDATE, DELETE",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			logs := startWithRecordGrants(t, grants)
			require.Contains(t, logs, "grant SELECT, INSERT, UPDATE, DELETE ON "+seqTable, "the sequences' record, at start")
			require.Contains(t, logs, "grant SELECT, INSERT, UPDATE ON "+factsTable, "the facts' record, at start")
		})
	}
}

// startWithRecordGrants starts a capture whose role holds grants on the
// capture's records, made beforehand by another role, and returns its log.
func startWithRecordGrants(t *testing.T, grants string) string {
	t.Helper()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	capRole := db + "_capture"
	e.exec(t, `CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+db+` TO `+capRole+`;
		CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		ALTER TABLE items OWNER TO `+capRole+`;
		CREATE SCHEMA IF NOT EXISTS epitaph; `+sqlSeqTable+`;
		`+sqlFactsTable+`;
		GRANT USAGE ON SCHEMA epitaph, `+stateSchema+` TO `+capRole+`;
		GRANT `+grants+` ON `+seqTable+`, `+factsTable+` TO `+capRole)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+capRole+` CASCADE`)
	})
	var logs lockedBuffer
	cfg := e.config()
	cfg.SourceURL = pg.UserURL(capRole, db)
	cfg.Tables = []string{"items"}
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	require.NoError(t, svc.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	return logs.String()
}
