package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// handlers add --secret-file with a relative path reads the file from the
// CLI's working directory, and stores it absolute: a projector started
// elsewhere (a service's working directory is /) reads the same file
// (stored as given, every delivery failed with code=secret_file).
func TestHandlersAddStoresTheSecretFileAbsolute(t *testing.T) {
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hook.secret"), []byte(handler.NewSecret()+"\n"), 0o600))
	t.Chdir(dir)
	var out, errOut bytes.Buffer
	env := &Env{Getenv: func(k string) string {
		return map[string]string{"EPITAPH_TARGET_URL": url}[k]
	}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
	const id = "4b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90"
	err := dispatch(ctx, []string{"handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook",
		"--target", "https://hooks.example/p", "--secret-file", "hook.secret"}, env)
	if err != nil {
		require.Equal(t, cli.ExitUsage, cli.Code(err), "refused as a usage error: %v", err)
		return
	}
	// The projector runs elsewhere.
	t.Chdir(t.TempDir())
	out.Reset()
	require.NoError(t, dispatch(ctx, []string{"handlers", "show", id}, env))
	require.NotContains(t, out.String(), "cannot be read", "the secret file the add accepted is not the one the projectors read:\n%s", out.String())
}

// --target-url defaults to EPITAPH_SOURCE_URL; a configuration file that
// sets source-url (its keys are the flags' names, and it is read by every
// command so that URLs are set once) must give the same default, not
// "no target database".
func TestConfigSourceURLIsTheTargetDefault(t *testing.T) {
	url := testenv.NewDatabase(t)
	code, _, stderr := projector(t, map[string]string{"EPITAPH_SOURCE_URL": url}, "migrate")
	require.Equal(t, 0, code, "by the variable: %s", stderr)
	code, _, stderr = projector(t, map[string]string{"EPITAPH_SOURCE_URL": url}, "handlers", "list")
	require.Equal(t, 0, code, "by the variable: %s", stderr)
	cfg := filepath.Join(t.TempDir(), "projector.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte("source-url: "+url+"\n"), 0o600))
	code, _, stderr = projector(t, nil, "run", "--config", cfg, "--help")
	require.Equal(t, 0, code, stderr)
	code, _, stderr = projector(t, map[string]string{"EPITAPH_CONFIG": cfg}, "handlers", "list")
	require.Equal(t, 0, code, "by the file: %s", stderr)
}

// The target stores a handler's durations in whole milliseconds: one
// below a millisecond is a usage error (exit 2), said as such, not the
// database's check refusing a zero interval (exit 1), nor a --batch-wait
// silently stored as 0.
func TestHandlersAddRefusesDurationsBelowAMillisecond(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	env := &Env{Getenv: func(k string) string {
		return map[string]string{"EPITAPH_TARGET_URL": url}[k]
	}, Stdout: io.Discard, Stderr: io.Discard, Logger: slog.New(slog.DiscardHandler)}
	for _, flag := range [][]string{{"--backoff", "500us"}, {"--claim-timeout", "900us"}, {"--batch-size", "10", "--batch-wait", "200us"}} {
		args := append([]string{"handlers", "add", "--table", "public.orders", "--kind", "webhook",
			"--target", "https://hooks.example/p"}, flag...)
		err := dispatch(ctx, args, env)
		require.Error(t, err, "%v", flag)
		require.Equal(t, cli.ExitUsage, cli.Code(err), "%v: %v", flag, err)
		require.ErrorContains(t, err, "millisecond", "%v", flag)
	}
}
