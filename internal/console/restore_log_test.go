package console_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// lockedBuffer is a log destination the handlers may write concurrently.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A restore the source refuses with an error that quotes the row's value
// (here a validation trigger's; Postgres's own "invalid input value" errors
// do the same) is answered with the value hidden, and the console's log
// line about it hides the value too: the log is read by more people than
// the archive, and the archived row is deleted (possibly personal) data.
func TestConsoleRestoreFailureLogHidesRowValues(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	const value = "row-value-7731@example.com"
	testenv.Exec(t, e.src, `ALTER TABLE public.notes REPLICA IDENTITY FULL; INSERT INTO public.notes VALUES (7731, '`+value+`'); DELETE FROM public.notes WHERE id = 7731`)
	e.caughtUp()
	var corr string
	require.NoError(t, e.target.QueryRow(ctx, `SELECT correlation_id FROM archive.rows WHERE table_name = 'notes' AND key = '{"id":7731}'`).Scan(&corr))
	testenv.Exec(t, e.src, `CREATE FUNCTION public.notes_check() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'note body "%" is not allowed', NEW.body; END $$;
		CREATE TRIGGER notes_check BEFORE INSERT ON public.notes FOR EACH ROW EXECUTE FUNCTION public.notes_check()`)

	var logs lockedBuffer
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: e.target, Token: loadToken(t), Source: "main", SourceURL: testenv.NoSearchPath(e.src),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	code, body := post(t, srv.URL, "/console/api/restore", `{"correlation_id": "`+corr+`", "dry_run": false}`, "Authorization", "Bearer "+token)
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	require.NotContains(t, body, value, "the answer hides the row's value")
	require.Contains(t, logs.String(), "console: restore failed", "the failure is logged")
	require.NotContains(t, logs.String(), value, "the log hides the row's value:\n%s", logs.String())
	require.True(t, strings.Contains(logs.String(), "SQLSTATE P0001"), "the log still says what failed:\n%s", logs.String())
}

func loadToken(t *testing.T) *httptoken.Token {
	t.Helper()
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token+"\n"), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	return tok
}
