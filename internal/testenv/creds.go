package testenv

import (
	"os"
	"testing"

	"github.com/nats-io/jwt/v2"
	"github.com/stretchr/testify/require"
)

// CredsUser returns the user name and public key of a NATS credentials
// file.
func CredsUser(t testing.TB, path string) (name, pub string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	tok, err := jwt.ParseDecoratedJWT(raw)
	require.NoError(t, err)
	uc, err := jwt.DecodeUserClaims(tok)
	require.NoError(t, err)
	return uc.Name, uc.Subject
}
