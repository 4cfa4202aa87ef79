package snapshot

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/epitaph-dev/epitaph/event"
)

// shopGroup is a transaction like the bench's: orders deleted with their
// lines, line notes and shipments (7 rows an order), refs as captured.
func shopGroup(orders int) (Group, map[string]int) {
	c := &event.Event{Op: event.OpCommit, Source: "bench", XID: 7, CommitLSN: 0x3C000000, Tables: map[string]int{}}
	toOrder := []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"id"}}}
	toLine := []event.Ref{{Columns: []string{"order_id", "line_no"}, Schema: "public", Table: "lines", RefColumns: []string{"order_id", "line_no"}}}
	var rows []Row
	add := func(table string, key, row string, refs []event.Ref) {
		rows = append(rows, Row{Schema: "public", Table: table, Identity: "full", Key: json.RawMessage(key), Row: json.RawMessage(row),
			Refs: refs, Seq: len(rows), CommitTime: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)})
		c.Tables["public."+table]++
	}
	for o := 1; o <= orders; o++ {
		for l := 1; l <= 2; l++ {
			for n := 1; n <= 3-l; n++ {
				add("line_notes", fmt.Sprintf(`{"id": %d}`, o*10+l*3+n),
					fmt.Sprintf(`{"id": %d, "body": "note %d for the line", "line_no": %d, "order_id": %d}`, o*10+l*3+n, n, l, o), toLine)
			}
			add("lines", fmt.Sprintf(`{"line_no": %d, "order_id": %d}`, l, o),
				fmt.Sprintf(`{"qty": %d, "sku": "SKU-%d", "price": "3.33", "line_no": %d, "order_id": %d}`, l*2, l, l, o), toOrder)
		}
		add("shipments", fmt.Sprintf(`{"id": %d}`, o), fmt.Sprintf(`{"id": %d, "carrier": "DHL", "order_id": %d}`, o, o), toOrder)
		add("orders", fmt.Sprintf(`{"id": %d}`, o),
			fmt.Sprintf(`{"id": %d, "note": "deliver to the back door", "total": "12.50", "status": "paid", "placed_at": "2026-11-30T09:00:00.123456+01:00", "customer_id": %d}`, o, o%97), nil)
	}
	c.Rows = len(rows)
	return Group{Commit: c, Rows: rows, ArchivedAt: time.Date(2026, 12, 1, 9, 0, 1, 0, time.UTC)}, c.Tables
}

// BenchmarkAssembleShopTransaction is the in-memory share of the in-page
// assembly of a 100-order transaction (700 rows, 100 documents): what
// CreateAssembled does before its statements.
func BenchmarkAssembleShopTransaction(b *testing.B) {
	gr, tables := shopGroup(100)
	roots := []string{"public.orders"}
	cfg := Config{Schema: "archive_v1"}
	cfg.setDefaults()
	b.ReportAllocs()
	for b.Loop() {
		jobs, lg, ok := assemble(gr, tables, roots)
		if !ok || len(jobs) != 100 {
			b.Fatalf("assembled %d jobs (%v)", len(jobs), ok)
		}
		var w assembledJobs
		for _, j := range jobs {
			out := lg.outcome(j, &cfg)
			if out.status != StatusComplete {
				b.Fatalf("job %s: %s", out.status, out.reason)
			}
			root, _ := lg.g.index(j.rootSeq) // a row of the group
			w.add(assembledJob{commit: gr.Commit, job: j, rootKey: lg.g.rows[root].Key, expected: "{}",
				expectedRows: gr.Commit.Rows, out: out, fp: lg.fp})
		}
	}
}
