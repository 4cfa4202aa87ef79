package capture

import (
	"encoding/json"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/rowsql"
)

// RestoreSQL builds the INSERT that puts a deleted row back from its event
// alone: every value's text form (see ValueText) is cast to the column's
// type as the event names it, `$n::text::<type>`, so the restored row is
// equal to the deleted one by row::text. Only the columns present in the
// row are inserted (a key-identity event carries its key columns only), and
// never a generated one. For an event with RowRef, set e.Row to the
// object's bytes first. See rowsql.InsertSQL, which `projector restore`
// shares.
func RestoreSQL(e *event.Event) (string, []any, error) { return rowsql.InsertSQL(e) }

func objectFields(b json.RawMessage) (map[string]json.RawMessage, []string, error) {
	return rowsql.ObjectFields(b)
}

func checkTypeName(t string) error { return rowsql.CheckTypeName(t) }
