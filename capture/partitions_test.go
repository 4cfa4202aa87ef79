package capture

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// TestLeafWithAnotherReplicaIdentityIndexIsNeverLabelledWhole: the root is
// FULL, one leaf has REPLICA IDENTITY USING INDEX on a column outside the
// primary key. pgoutput labels the leaf's old tuple by the root's identity,
// so it comes as a "whole" row holding the index column only, NULL in the
// primary key. Such a row is labelled key, with no invented NULLs and no
// key of NULLs.
func TestLeafWithAnotherReplicaIdentityIndexIsNeverLabelledWhole(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pu (id int, region text, code text NOT NULL, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pu_eu PARTITION OF pu FOR VALUES IN ('eu');
		CREATE TABLE pu_us PARTITION OF pu FOR VALUES IN ('us');
		ALTER TABLE pu REPLICA IDENTITY FULL; ALTER TABLE pu_eu REPLICA IDENTITY FULL;
		CREATE UNIQUE INDEX pu_us_code ON pu_us (code);
		ALTER TABLE pu_us REPLICA IDENTITY USING INDEX pu_us_code;
		INSERT INTO pu VALUES (1, 'eu', 'c1', 'a'), (2, 'us', 'c2', 'b')`)
	e.start(t, func(c *Config) { c.Tables = []string{"pu"}; c.CatalogPoll = -1 }) // --allow-key-only
	e.exec(t, `DELETE FROM pu WHERE id = 1; DELETE FROM pu WHERE id = 2`)
	got := deletesOf(e.deletes(t, "main", 2), "public.pu")
	require.Len(t, got, 2)
	require.Equal(t, event.IdentityFull, got[0].Identity)
	require.JSONEq(t, `{"id":1,"region":"eu","code":"c1","v":"a"}`, string(got[0].Row))
	require.JSONEq(t, `{"id":1,"region":"eu"}`, string(got[0].Key))

	require.Equal(t, event.IdentityKey, got[1].Identity, "the WAL holds the leaf's index column only: %s", got[1].Row)
	require.JSONEq(t, `{"code":"c2"}`, string(got[1].Row), "no fabricated NULLs")
	if len(got[1].Key) > 0 && string(got[1].Key) != "null" {
		var key map[string]any
		require.NoError(t, json.Unmarshal(got[1].Key, &key))
		require.NotContains(t, key, "id", "never a primary key of NULLs")
	}
}

// TestLeafIdentifiedByAWiderIndexIsNeverLabelledWhole: a leaf's replica
// identity index holds the primary key and more, so its "whole" rows hold
// no NULL in the primary key, only in the columns the index leaves out:
// labelled key, never full with those NULLs invented.
func TestLeafIdentifiedByAWiderIndexIsNeverLabelledWhole(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pw (id int, region text, code text NOT NULL, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pw_eu PARTITION OF pw FOR VALUES IN ('eu');
		CREATE TABLE pw_us PARTITION OF pw FOR VALUES IN ('us');
		ALTER TABLE pw REPLICA IDENTITY FULL; ALTER TABLE pw_eu REPLICA IDENTITY FULL;
		CREATE UNIQUE INDEX pw_us_code ON pw_us (id, region, code);
		ALTER TABLE pw_us REPLICA IDENTITY USING INDEX pw_us_code;
		INSERT INTO pw VALUES (1, 'eu', 'c1', 'a'), (2, 'us', 'c2', 'b')`)
	e.start(t, func(c *Config) { c.Tables = []string{"pw"}; c.CatalogPoll = -1 }) // --allow-key-only
	e.exec(t, `DELETE FROM pw WHERE id = 1; DELETE FROM pw WHERE id = 2`)
	got := deletesOf(e.deletes(t, "main", 2), "public.pw")
	require.Len(t, got, 2)
	require.Equal(t, event.IdentityFull, got[0].Identity)
	require.JSONEq(t, `{"id":1,"region":"eu","code":"c1","v":"a"}`, string(got[0].Row))
	require.Equal(t, event.IdentityKey, got[1].Identity, "the WAL holds the leaf's index columns only: %s", got[1].Row)
	require.JSONEq(t, `{"id":2,"region":"us","code":"c2"}`, string(got[1].Row), "no fabricated NULLs")
	require.JSONEq(t, `{"id":2,"region":"us"}`, string(got[1].Key))
}

// TestTruncateOfOnePartitionIsAnnounced: PostgreSQL does not send the
// TRUNCATE of one partition of a table published via its root, so the
// capture cannot publish it; it says so, naming the partitioned tables, at
// start and when it adds one while streaming.
func TestTruncateOfOnePartitionIsAnnounced(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pm (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pm_eu PARTITION OF pm FOR VALUES IN ('eu');
		CREATE TABLE pm_us PARTITION OF pm FOR VALUES IN ('us');
		CREATE TABLE other (id int PRIMARY KEY);
		INSERT INTO pm VALUES (1, 'eu', 'a'), (2, 'us', 'b'); INSERT INTO other VALUES (1), (2)`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SetReplicaIdentityFull = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	require.Contains(t, logs.String(), `msg="TRUNCATE of a single partition of these partitioned tables is NOT captured`)
	require.Contains(t, logs.String(), `tables=[public.pm]`)

	// What the warning is about: the partition's TRUNCATE publishes
	// nothing, the partitioned table's does.
	e.exec(t, `TRUNCATE pm_eu`)
	e.exec(t, `DELETE FROM other WHERE id = 1`)
	e.exec(t, `TRUNCATE pm`)
	e.exec(t, `DELETE FROM other WHERE id = 2`)
	ms := e.messages(t, "main", 5)
	require.Equal(t, []string{"delete public.other", "commit", "truncate public.pm", "commit", "delete public.other", "commit"}, ops(ms)[:6])

	e.exec(t, `CREATE TABLE later (id int PRIMARY KEY) PARTITION BY RANGE (id); CREATE TABLE later_1 PARTITION OF later FOR VALUES FROM (0) TO (10)`)
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `tables=[public.later]`)
	}, 60*time.Second, 50*time.Millisecond, "a partitioned table added while streaming is announced too")
}

// TestUnloggedPartitionIsReportedNotCaptured: an unlogged partition's
// deletes are not in the WAL, so a published partitioned table loses them;
// the capture lists such a partition as not captured (at start, in the
// status, and when one appears while streaming) instead of saying nothing.
func TestUnloggedPartitionIsReportedNotCaptured(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pl (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pl_eu PARTITION OF pl FOR VALUES IN ('eu');
		CREATE UNLOGGED TABLE pl_us PARTITION OF pl FOR VALUES IN ('us');
		INSERT INTO pl VALUES (1, 'eu', 'a'), (2, 'us', 'b')`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SetReplicaIdentityFull = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	const note = `public.pl_us: unlogged partition of public.pl: its deletes are not in the WAL and are not captured`
	require.Contains(t, logs.String(), `msg="table not captured" table="`+note+`"`)
	require.Contains(t, svc.CurrentStatus().SkippedTables, note)

	// What it warns of: the unlogged partition's delete publishes nothing.
	e.exec(t, `DELETE FROM pl WHERE id = 2; DELETE FROM pl WHERE id = 1`)
	got := deletesOf(e.deletes(t, "main", 1), "public.pl")
	require.Len(t, got, 1)
	require.JSONEq(t, `{"id":1,"region":"eu","v":"a"}`, string(got[0].Row))

	e.exec(t, `CREATE UNLOGGED TABLE pl_fr PARTITION OF pl FOR VALUES IN ('fr')`)
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `table="public.pl_fr: unlogged partition of public.pl`)
	}, 60*time.Second, 50*time.Millisecond, "one made while streaming is reported too")
	require.Equal(t, 1, strings.Count(logs.String(), `table="`+note), "once")
}

// TestRowMovedOutOfALeafIdentifiedByItsOwnIndexIsNoDelete: an UPDATE that
// moves a row out of a leaf with REPLICA IDENTITY USING INDEX (columns
// other than the primary key) comes as a delete holding the index columns
// only, then the insert. It is a move, not a delete; a real delete from
// that leaf is still published.
func TestRowMovedOutOfALeafIdentifiedByItsOwnIndexIsNoDelete(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pv (id int, region text, code text NOT NULL, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pv_eu PARTITION OF pv FOR VALUES IN ('eu');
		CREATE TABLE pv_us PARTITION OF pv FOR VALUES IN ('us');
		ALTER TABLE pv REPLICA IDENTITY FULL; ALTER TABLE pv_eu REPLICA IDENTITY FULL;
		CREATE UNIQUE INDEX pv_us_code ON pv_us (code);
		ALTER TABLE pv_us REPLICA IDENTITY USING INDEX pv_us_code;
		CREATE TABLE other (id int PRIMARY KEY); ALTER TABLE other REPLICA IDENTITY FULL; INSERT INTO other VALUES (1);
		INSERT INTO pv VALUES (1, 'eu', 'c1', 'a'), (2, 'us', 'c2', 'b'), (3, 'us', 'c3', 'c')`)
	e.start(t, func(c *Config) { c.Tables = []string{"pv", "other"}; c.CatalogPoll = -1 }) // --allow-key-only
	e.exec(t, `UPDATE pv SET region = 'eu' WHERE id = 2`)
	e.exec(t, `UPDATE pv SET region = 'us', code = 'c1x' WHERE id = 1`)
	e.exec(t, `DELETE FROM pv WHERE id = 3; DELETE FROM other`)
	ms := e.deletes(t, "main", 2)
	require.Equal(t, []string{"delete public.pv", "delete public.other"}, ops(ms), "the moves publish nothing")
	require.Equal(t, event.IdentityKey, ms[0].ev.Identity)
	require.JSONEq(t, `{"code":"c3"}`, string(ms[0].ev.Row))
}

// TestDroppedOrDetachedPartitionIsRecordedAsATruncate: dropping or
// detaching a partition takes its rows out of the partitioned table with
// no row change in the WAL. The capture notices the partition gone at its
// next catalog check and publishes a truncate of the partitioned table in
// a transaction of its own (readers are told, as for a TRUNCATE), while
// the other partitions' deletes go on being captured. (A detached
// partition is a table of its own: with every table captured, the
// catalog poll publishes it.)
func TestDroppedOrDetachedPartitionIsRecordedAsATruncate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pd (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pd_eu PARTITION OF pd FOR VALUES IN ('eu');
		CREATE TABLE pd_us PARTITION OF pd FOR VALUES IN ('us');
		CREATE TABLE pd_ap PARTITION OF pd FOR VALUES IN ('ap');
		INSERT INTO pd VALUES (1, 'eu', 'a'), (2, 'us', 'b'), (3, 'ap', 'c'), (4, 'ap', 'd')`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SetReplicaIdentityFull = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))

	e.exec(t, `DROP TABLE pd_eu`)
	ms := e.messages(t, "main", 2)
	require.Equal(t, []string{"truncate public.pd", "commit"}, ops(ms), "the drop, as a truncate of the partitioned table")
	e.exec(t, `ALTER TABLE pd DETACH PARTITION pd_us`)
	ms = e.messages(t, "main", 4)
	require.Equal(t, []string{"truncate public.pd", "commit"}, ops(ms[2:4]), "the detach")
	e.exec(t, `DELETE FROM pd WHERE id = 3`)
	ms = e.messages(t, "main", 6)
	require.Equal(t, []string{"delete public.pd", "commit"}, ops(ms[4:6]), "a delete of a partition still there")
	require.Contains(t, logs.String(), `partition=public.pd_eu`)
	require.Contains(t, logs.String(), `msg="partition dropped: `)
	require.Contains(t, logs.String(), `msg="partition detached: `)

	// Anyone may write such a message: one naming a table the capture does
	// not publish is ignored, the others are published only in a
	// transaction.
	e.exec(t, `SELECT pg_logical_emit_message(true, 'epitaph.partition_removed', '{"schema":"public","table":"nope","leaf":"x","how":"dropped"}');
		DELETE FROM pd WHERE id = 4`)
	ms = e.messages(t, "main", 8)
	require.Equal(t, []string{"delete public.pd", "commit"}, ops(ms[6:8]))
}

// TestPartitionRemovedWhileTheCaptureWasStoppedIsRecordedAtItsStart: the
// published partitions are recorded on the source, so a partition dropped
// or detached while the capture was stopped (a retention job's nightly
// drop during a deploy) is recorded as a truncate of its table when the
// capture starts again, once: a later start records nothing more.
func TestPartitionRemovedWhileTheCaptureWasStoppedIsRecordedAtItsStart(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE pd (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE pd_eu PARTITION OF pd FOR VALUES IN ('eu');
		CREATE TABLE pd_us PARTITION OF pd FOR VALUES IN ('us');
		CREATE TABLE pd_ap PARTITION OF pd FOR VALUES IN ('ap');
		INSERT INTO pd VALUES (1, 'eu', 'a'), (2, 'us', 'b'), (3, 'ap', 'c'), (4, 'eu', 'd'), (5, 'eu', 'e')`)
	start := func() (*Service, *lockedBuffer) {
		var logs lockedBuffer
		cfg := e.config()
		fastPoll(&cfg)
		cfg.SetReplicaIdentityFull = true
		svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
		require.NoError(t, err)
		require.NoError(t, svc.Start(context.Background()))
		return svc, &logs
	}
	svc, _ := start()
	e.exec(t, `DELETE FROM pd WHERE id = 1`)
	require.Equal(t, []string{"delete public.pd", "commit"}, ops(e.messages(t, "main", 2)))
	require.NoError(t, svc.Stop(context.Background()))

	e.exec(t, `DROP TABLE pd_us; ALTER TABLE pd DETACH PARTITION pd_ap`)
	svc, logs := start()
	e.exec(t, `DELETE FROM pd WHERE id = 4`)
	ms := e.messages(t, "main", 8)
	require.Equal(t, []string{"truncate public.pd", "commit", "truncate public.pd", "commit", "delete public.pd", "commit"}, ops(ms[2:8]),
		"the drop and the detach, recorded at the start")
	require.Contains(t, logs.String(), `partition=public.pd_us`)
	require.Contains(t, logs.String(), `msg="partition dropped: `)
	require.Contains(t, logs.String(), `partition=public.pd_ap`)
	require.Contains(t, logs.String(), `msg="partition detached: `)
	require.NoError(t, svc.Stop(context.Background()))

	svc, logs = start()
	e.exec(t, `DELETE FROM pd WHERE id = 5`)
	ms = e.messages(t, "main", 10)
	require.Equal(t, []string{"delete public.pd", "commit"}, ops(ms[8:10]), "nothing recorded twice")
	require.NotContains(t, logs.String(), `msg="partition`)
	require.NoError(t, svc.Stop(context.Background()))
}
