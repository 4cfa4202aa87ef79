package restore_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/restore"
)

// A support tool puts a deleted customer back: plan first (a dry run
// writes nothing and lists the rows, their order and any conflicts), then
// restore only that customer's subtree of the transaction that deleted
// it. The restore is one source transaction, recorded in epitaph.restores.
func ExampleRun() {
	ctx := context.Background()
	target, err := pgxpool.New(ctx, "postgres://epitaph@target/app") // where the archive is
	if err != nil {
		log.Fatal(err)
	}
	defer target.Close()
	source, err := pgx.Connect(ctx, "postgres://app@source/app") // where the rows go back
	if err != nil {
		log.Fatal(err)
	}
	defer source.Close(ctx)

	cfg := restore.Config{
		Source:        "main",
		CorrelationID: "main:88213:0/5A1C2F0", // archive.rows.correlation_id
		RootTable:     "public.customers",
		RootKey:       json.RawMessage(`{"id":42}`),
		OnConflict:    restore.OnConflictAbort,
		DryRun:        true,
	}
	plan, err := restore.Run(ctx, target, source, cfg)
	if err != nil {
		log.Fatal(err)
	}
	for _, t := range plan.Tables {
		fmt.Printf("%+v\n", t)
	}
	if len(plan.Conflicts) > 0 {
		log.Fatalf("%d rows are back already", len(plan.Conflicts))
	}
	cfg.DryRun, cfg.Actor = false, "support:ann"
	done, err := restore.Run(ctx, target, source, cfg)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("restored", done.Restored, "rows, recorded as restore", done.ID)
}
