package projection

import (
	"bytes"
	"encoding/json"
	"strings"

	"github.com/epitaph-dev/epitaph/event"
)

// rootsInPage computes is_root in memory for every transaction whose
// commit and all of whose rows are in this page, with the same rule as
// markRootsSQL: a row is a root unless another row of its transaction is
// its parent by one of its refs (all key values present, non-null and
// equal to the parent's referenced columns). It returns the commit LSNs it
// settled; the others are marked in SQL when their commit is applied.
func rootsInPage(rows []*archiveRow, commits []*item) map[event.LSN]bool {
	settled := map[event.LSN]bool{}
	if len(commits) == 0 {
		return settled
	}
	byTx := map[event.LSN][]*archiveRow{}
	for _, r := range rows {
		byTx[r.ev.CommitLSN] = append(byTx[r.ev.CommitLSN], r)
	}
	for _, c := range commits {
		txRows := byTx[c.ev.CommitLSN]
		if !completeTx(txRows, c.ev.Rows) {
			continue
		}
		markRootsInMemory(txRows)
		settled[c.ev.CommitLSN] = true
	}
	return settled
}

// completeTx says whether rows are exactly seqs 0..n-1 of a transaction.
func completeTx(rows []*archiveRow, n int) bool {
	if len(rows) != n || n == 0 {
		return false
	}
	seen := make([]bool, n)
	for _, r := range rows {
		if r.ev.Seq < 0 || r.ev.Seq >= n || seen[r.ev.Seq] {
			return false
		}
		seen[r.ev.Seq] = true
	}
	return true
}

func markRootsInMemory(rows []*archiveRow) {
	yes, no := true, false
	anyRefs := false
	for _, r := range rows {
		if len(r.ev.Refs) > 0 {
			anyRefs = true
			break
		}
	}
	if !anyRefs {
		for _, r := range rows {
			r.isRoot = &yes
		}
		return
	}
	values := make([]map[string]json.RawMessage, len(rows))
	for i, r := range rows {
		_ = json.Unmarshal(r.row, &values[i]) // unreadable: no values, so neither parent nor child
	}
	// Index the candidate parents under every (table, columns) some ref
	// points at.
	wanted := map[string]bool{}
	for _, r := range rows {
		for _, f := range r.ev.Refs {
			wanted[specKey(f.Schema, f.Table, f.RefColumns)] = true
		}
	}
	parents := map[string][]int{}
	for i, r := range rows {
		for spec := range wanted {
			schema, table, cols := splitSpec(spec)
			if schema != r.ev.Schema || table != r.ev.Table {
				continue
			}
			if k, ok := keyOf(values[i], cols); ok {
				parents[spec+"\x01"+k] = append(parents[spec+"\x01"+k], r.ev.Seq)
			}
		}
	}
	for i, r := range rows {
		root := true
		for _, f := range r.ev.Refs {
			k, ok := keyOf(values[i], f.Columns)
			if !ok {
				continue
			}
			for _, seq := range parents[specKey(f.Schema, f.Table, f.RefColumns)+"\x01"+k] {
				if seq != r.ev.Seq {
					root = false
				}
			}
		}
		if root {
			r.isRoot = &yes
		} else {
			r.isRoot = &no
		}
	}
}

func specKey(schema, table string, cols []string) string {
	return schema + "\x00" + table + "\x00" + strings.Join(cols, "\x00")
}

func splitSpec(spec string) (schema, table string, cols []string) {
	parts := strings.Split(spec, "\x00")
	return parts[0], parts[1], parts[2:]
}

// keyOf is the values of cols in compact JSON, and false when one is
// missing or null (a NULL foreign key references nothing).
func keyOf(values map[string]json.RawMessage, cols []string) (string, bool) {
	if values == nil || len(cols) == 0 {
		return "", false
	}
	var b strings.Builder
	for _, c := range cols {
		v, ok := values[c]
		if !ok {
			return "", false
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, v); err != nil || buf.String() == "null" {
			return "", false
		}
		b.Write(buf.Bytes())
		b.WriteByte(0)
	}
	return b.String(), true
}
