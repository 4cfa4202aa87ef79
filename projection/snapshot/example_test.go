package snapshot_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// Any program may run the snapshot batch on its own schedule, beside or
// instead of the projector's: batches claim their jobs with SKIP LOCKED, so
// any number run at once, and a failed batch leaves its jobs pending.
func ExampleRunBatch() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://epitaph@target/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	for ctx.Err() == nil {
		res, err := snapshot.RunBatch(ctx, pool, snapshot.Config{Schema: "archive_v1", BatchSize: 200})
		if err != nil {
			log.Printf("snapshot batch: %v", err) // its jobs stay pending
		}
		if res.Claimed == 0 {
			time.Sleep(time.Second) // nothing due
		}
	}
}
