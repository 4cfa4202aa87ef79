package capture

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func columnNames(e *event.Event) []string {
	var out []string
	for _, c := range e.Columns {
		out = append(out, c.Name+":"+c.Type)
	}
	return out
}

// TestSchemaChanges changes the table between deletes while the capture is
// stopped, so every event is decoded against a catalog that has moved on:
// each event still describes the row as it was when deleted.
func TestSchemaChanges(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TYPE color AS ENUM ('red', 'blue');
		CREATE TABLE t (id int PRIMARY KEY, a text, c color); ALTER TABLE t REPLICA IDENTITY FULL;
		CREATE TABLE u (id int PRIMARY KEY); ALTER TABLE u REPLICA IDENTITY FULL;
		INSERT INTO t VALUES (1, 'one', 'red'), (2, 'two', 'blue'), (3, 'three', NULL), (4, 'four', 'red');
		INSERT INTO u VALUES (1)`)
	svc := e.start(t, func(c *Config) { c.Tables = []string{"t"} })
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	e.exec(t, `DELETE FROM t WHERE id = 1;
		ALTER TABLE t ADD COLUMN b bigint DEFAULT 9007199254740993;
		DELETE FROM t WHERE id = 2;
		ALTER TABLE t DROP COLUMN a;
		DELETE FROM t WHERE id = 3;
		ALTER TABLE t RENAME TO t2;
		DELETE FROM t2 WHERE id = 4;
		DROP TABLE t2; DROP TYPE color`)

	// A table added to the list between restarts joins the publication.
	svc = e.start(t, func(c *Config) { c.Tables = []string{"public.u"} })
	require.Equal(t, []string{"public.u"}, svc.CurrentStatus().PublicationTables)
	e.exec(t, `DELETE FROM u`)
	ms := e.deletes(t, "main", 5)
	require.Equal(t, []string{"id:integer", "a:text", "c:public.color"}, columnNames(ms[0].ev))
	require.JSONEq(t, `{"id":1,"a":"one","c":"red"}`, string(ms[0].ev.Row))
	require.Equal(t, []string{"id:integer", "a:text", "c:public.color", "b:bigint"}, columnNames(ms[1].ev))
	require.JSONEq(t, `{"id":2,"a":"two","c":"blue","b":9007199254740993}`, string(ms[1].ev.Row))
	require.Equal(t, []string{"id:integer", "c:public.color", "b:bigint"}, columnNames(ms[2].ev))
	require.JSONEq(t, `{"id":3,"c":null,"b":9007199254740993}`, string(ms[2].ev.Row))
	require.Equal(t, "t2", ms[3].ev.Table, "events name the table as it was called when the row was deleted")
	require.JSONEq(t, `{"id":4,"c":"red","b":9007199254740993}`, string(ms[3].ev.Row))
	require.Equal(t, "u", ms[4].ev.Table)
}
