package statuspage_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// Without a token (--http-token-file) the projector serves its HTTP
// address on loopback only, yet a browser reaches it under any name that
// resolves there and lets that name's pages read the answer (DNS
// rebinding): the status page names tables and quarantined rows' keys, so
// like the read API and the console it answers only requests for a
// loopback host (403 otherwise). With a token the address may be another
// (a private network), and the page answers any host as before.
func TestStatusPageWithoutTokenAnswersLoopbackHostsOnly(t *testing.T) {
	t.Parallel()
	st := sampleStatus()
	src := func(context.Context) (*status.Status, error) { return st, nil }
	serve := func(h http.Handler, host string) int {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.Host = host
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	open := statuspage.Handler(src, statuspage.WithActions(statuspage.QuarantineActions(nil, nil), nil))
	for _, host := range []string{"127.0.0.1:9188", "localhost:9188", "[::1]:9188", "LOCALHOST"} {
		require.Equal(t, http.StatusOK, serve(open, host), host)
	}
	for _, host := range []string{"rebind.attacker.example:9188", "attacker.example", "10.0.0.5:9188"} {
		require.Equal(t, http.StatusForbidden, serve(open, host), host)
	}

	tokFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokFile, []byte("0123456789abcdef0123"), 0o600))
	tok, err := httptoken.Load(tokFile)
	require.NoError(t, err)
	withToken := statuspage.Handler(src, statuspage.WithActions(statuspage.QuarantineActions(nil, nil), tok))
	require.Equal(t, http.StatusOK, serve(withToken, "projector.internal:9188"))
}
