package readapi

import (
	"io"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// getAs sends a GET whose Host header is host, as a browser does for a page
// of a name that resolves to the projector's loopback address.
func (e *env) getAs(host, path string) (int, string) {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.api.URL+path, nil)
	require.NoError(e.t, err)
	req.Host = host
	res, err := http.DefaultClient.Do(req)
	require.NoError(e.t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(e.t, err)
	return res.StatusCode, string(b)
}

// Without a token the read API (on loopback) answers only requests
// addressed to a loopback host: a web page whose name an attacker rebinds
// to 127.0.0.1 (DNS rebinding) cannot read deleted rows through the
// operator's browser.
func TestReadAPIWithoutTokenRefusesAnotherHost(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	e.deleteTx(42)
	e.startProjector()
	path := rowsPath("public.customers", `{"id":42}`)
	u, err := url.Parse(e.api.URL)
	require.NoError(t, err)
	port := u.Port()
	require.Eventually(t, func() bool {
		code, _ := e.getAs("127.0.0.1:"+port, path)
		return code == http.StatusOK
	}, 120*time.Second, 100*time.Millisecond)
	for _, host := range []string{"localhost:" + port, "LocalHost", "[::1]:" + port, "127.0.0.1"} {
		code, body := e.getAs(host, path)
		require.Equal(t, http.StatusOK, code, "%s: %s", host, body)
	}
	for _, host := range []string{"rebind.attacker.example:" + port, "rebind.attacker.example", "localhost.attacker.example:" + port, "10.0.0.7:" + port} {
		code, body := e.getAs(host, path)
		require.Equal(t, http.StatusForbidden, code, "%s: %s", host, body)
		require.NotContains(t, body, "lsn ", "no row value for %s", host)
		require.Contains(t, body, "--http-token-file")
	}
}
