package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"
)

// withTargetPool runs f with a pool on the target database (the shape of
// most commands: connect, one call, print), closed when f returns.
func withTargetPool(ctx context.Context, c *common, f func(pool *pgxpool.Pool) error) error {
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	return f(pool)
}

// writeJSONList writes a list as a JSON array: [] when there is none.
func writeJSONList[T any](w io.Writer, items []T) error {
	if items == nil {
		items = []T{}
	}
	return writeJSON(w, items)
}

// writeTable prints items as an aligned table under a tab-separated
// header, one row each, and none on its own line when there are none.
func writeTable[T any](w io.Writer, header string, items []T, none string, row func(w io.Writer, item T)) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, it := range items {
		row(tw, it)
	}
	tw.Flush()
	if len(items) == 0 {
		fmt.Fprintln(w, none)
	}
}
