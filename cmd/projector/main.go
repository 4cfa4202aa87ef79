// Command projector applies a source's Epitaph stream to read models in a
// target Postgres: `projector run | migrate | status | ...` (one file per
// subcommand group; see commands.go).
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	env := &Env{Getenv: os.Getenv, Stdout: os.Stdout, Stderr: os.Stderr,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel(os.Getenv("EPITAPH_LOG_LEVEL"))}))}
	if err := dispatch(ctx, os.Args[1:], env); err != nil {
		fmt.Fprintln(os.Stderr, "projector:", err)
		stop()
		os.Exit(ExitCode(err))
	}
}
