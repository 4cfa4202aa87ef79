package capture

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestKeyRenamedBesideAStoredGeneratedColumn: a FULL table's key column
// renamed while its deletes are still in the slot is found by position
// (TestKeys). PostgreSQL 18 sends stored generated columns too
// (publish_generated_columns), which the positions must skip: before, the
// counts differed and the events came without a key.
func TestKeyRenamedBesideAStoredGeneratedColumn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE reng (id int PRIMARY KEY, g int GENERATED ALWAYS AS (id * 2) STORED, v text);
		ALTER TABLE reng REPLICA IDENTITY FULL; INSERT INTO reng (id, v) VALUES (1, 'r')`)
	svc := e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	e.exec(t, `DELETE FROM reng; ALTER TABLE reng RENAME COLUMN id TO ident`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	ev := e.deletes(t, "main", 1)[0].ev
	require.JSONEq(t, `{"id":1}`, string(ev.Key), "the key as it was named when the row was deleted")
	require.True(t, ev.Columns[0].PK)
	var row map[string]any
	require.NoError(t, json.Unmarshal(ev.Row, &row))
	require.Equal(t, float64(1), row["id"])
	require.Equal(t, "r", row["v"])
}
