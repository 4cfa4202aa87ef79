package capture

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// serverVersion is the server_version_num of the test's source.
func (e *env) serverVersion(t *testing.T) int {
	t.Helper()
	v, err := strconv.Atoi(queryString(t, e.db, `SELECT current_setting('server_version_num')`))
	require.NoError(t, err)
	return v
}

// A publication made beforehand (by a DBA, or an older tool) with a row
// filter would silently drop the deletes of the rows it leaves out, and a
// column list narrower than a FULL identity makes the application's
// DELETEs fail: the capture's start replaces both with the plain table.
func TestPublicationRowFilterAndColumnListAreRemoved(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if v := e.serverVersion(t); v < 150000 {
		t.Skipf("PostgreSQL %d has no row filters or column lists (15+)", v/10000)
	}
	e.exec(t, `CREATE TABLE shown (id int PRIMARY KEY, v text);
		ALTER TABLE shown REPLICA IDENTITY FULL;
		CREATE TABLE narrow (id int PRIMARY KEY, v text, w text);
		ALTER TABLE narrow REPLICA IDENTITY FULL;
		INSERT INTO shown VALUES (1, 'hidden'), (2, 'shown');
		INSERT INTO narrow VALUES (1, 'a', 'b');
		CREATE PUBLICATION epitaph FOR TABLE shown WHERE (v <> 'hidden'), narrow (id, v)
		  WITH (publish = 'delete, truncate', publish_via_partition_root = true)`)
	svc := e.start(t, nil)
	require.Equal(t, []string{"public.narrow", "public.shown"}, svc.CurrentStatus().PublicationTables)
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		WHERE p.pubname = 'epitaph' AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL)`))

	e.exec(t, `DELETE FROM shown WHERE id = 1`)
	e.exec(t, `DELETE FROM narrow`)
	ms := e.deletes(t, "main", 2)
	require.Equal(t, "shown", ms[0].ev.Table)
	require.JSONEq(t, `{"id":1,"v":"hidden"}`, string(ms[0].ev.Row), "the row the filter left out")
	require.Equal(t, "narrow", ms[1].ev.Table)
	require.JSONEq(t, `{"id":1,"v":"a","w":"b"}`, string(ms[1].ev.Row), "every column, not the list's")
}
