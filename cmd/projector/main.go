// Command projector applies a source's Epitaph stream to read models in a
// target Postgres: `projector run | migrate | status | ...` (one file per
// subcommand group; see commands.go).
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal starts the soft stop; from then on the signals are
	// no longer caught, so a second one kills at once (as with the capture).
	context.AfterFunc(ctx, stop)
	env := &Env{LookupEnv: os.LookupEnv, Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr}
	code := cli.Report(os.Stderr, "projector", dispatch(ctx, os.Args[1:], env))
	stop()
	os.Exit(code)
}
