package httptoken_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/httptoken"
)

const secret = "s3cret-token-0123456789"

func write(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(p, []byte(content), mode))
	require.NoError(t, os.Chmod(p, mode))
	return p
}

// Bad files are refused with one line that names the file and never the
// token.
func TestLoadRefusesBadFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, tc := range []struct {
		name, path, want string
	}{
		{"missing", filepath.Join(dir, "nope"), "no such file"},
		{"empty", write(t, " \n", 0o600), "is empty"},
		{"short", write(t, "abc\n", 0o600), "shorter than 16"},
		{"world-readable", write(t, secret, 0o644), "readable by every user (mode 0644): chmod 600 it"},
		{"two tokens", write(t, secret+"\n"+secret, 0o600), "white space"},
		{"a directory", dir, "not a regular file"},
		{"no path", "", "no file given"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := httptoken.Load(tc.path)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.True(t, strings.HasPrefix(err.Error(), "--http-token-file"), err.Error())
			require.NotContains(t, err.Error(), secret)
			require.NotContains(t, err.Error(), "\n")
		})
	}
}

// Only "Authorization: Bearer <token>" with the file's token passes; the
// token never shows when formatted.
func TestCheck(t *testing.T) {
	t.Parallel()
	tok, err := httptoken.Load(write(t, "  "+secret+"\n", 0o600))
	require.NoError(t, err)
	req := func(h string) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/", nil)
		if h != "" {
			r.Header.Set("Authorization", h)
		}
		return r
	}
	require.True(t, tok.Check(req("Bearer "+secret)))
	require.True(t, tok.Check(req("bearer "+secret)))
	for _, h := range []string{"", "Bearer", "Bearer ", "Bearer " + secret + "x", "Basic " + secret, secret, "Bearer " + secret[:10]} {
		require.False(t, tok.Check(req(h)), "header %q", h)
	}
	var none *httptoken.Token
	require.False(t, none.Check(req("Bearer "+secret)), "a nil token matches nothing")
	require.False(t, (&httptoken.Token{}).Check(req("Bearer ")), "a zero token matches nothing")
	for _, s := range []string{fmt.Sprint(tok), fmt.Sprintf("%v %+v %#v %s", tok, tok, tok, tok)} {
		require.NotContains(t, s, secret)
	}
	require.Equal(t, "[redacted]", tok.String())
}
