package erasure

import (
	"context"
	"encoding/json"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/handler"
)

// erasedRef is what an erased row's delivery records besides its
// identity: its table ("schema.table") and its transaction.
type erasedRef struct {
	id    rowIdentity
	table string
	corr  string
	key   json.RawMessage // the row's archived key (scrubRestores)
}

// stopCursorDeliveries records, in the erasure's transaction, the
// pending deliveries of the erased rows to cursor handlers as stopped
// (handler.StopErased: stop_revoked, keyless). A cursor handler's
// pending deliveries are the archived rows of its table after its
// cursor, so an erased row, gone from the archive, is never delivered;
// the stopped row says so where `deliveries list` looks. It comes before
// eraseDeliveries, which then also clears the key of a delivery a
// settle of a batch in flight wrote first.
func stopCursorDeliveries(ctx context.Context, tx pgx.Tx, erased []erasedRef) error {
	rows := make([]handler.CursorRow, len(erased))
	for i, e := range erased {
		schema, name, _ := strings.Cut(e.table, ".")
		rows[i] = handler.CursorRow{Source: e.id.source, Schema: schema, Table: name, CommitLSN: e.id.lsn.String(),
			Seq: e.id.seq, Correlation: e.corr}
	}
	_, err := handler.StopCursorRows(ctx, tx, rows, handler.StopErased)
	return err
}
