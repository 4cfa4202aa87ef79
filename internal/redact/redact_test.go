package redact_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/redact"
)

func TestURL(t *testing.T) {
	t.Parallel()
	cases := []struct{ in, want string }{
		{"postgres://u:s3cret@db:5432/app?sslmode=disable", "postgres://u:xxxxx@db:5432/app?sslmode=disable"},
		{"postgres://u@db/app?password=s3cret", "postgres://u@db/app?password=xxxxx"},
		{"nats://n:s3cret@127.0.0.1:4222", "nats://n:xxxxx@127.0.0.1:4222"},
		{"host=db user=u password=s3cret dbname=app", "host=db user=u password=xxxxx dbname=app"},
		{"host=db password='s3 cret' dbname=app", "host=db password=xxxxx dbname=app"},
		{"postgres://u@db/app", "postgres://u@db/app"},
		{"nats://s3cret@127.0.0.1:4222", "nats://xxxxx@127.0.0.1:4222"},
		{"tls://s3cret@nats:4222", "tls://xxxxx@nats:4222"},
		{"nats://s3cret@a:4222,nats://n:s3cret@b:4222", "nats://xxxxx@a:4222,nats://n:xxxxx@b:4222"},
		{"nats://a:4222,nats://b:4222", "nats://a:4222,nats://b:4222"},
	}
	for _, c := range cases {
		require.Equal(t, c.want, redact.URL(c.in), c.in)
		require.NotContains(t, redact.URL(c.in), "s3")
	}
	msg := `connect postgres://u:s3cret@db/app: failed (password=s3cret)`
	require.NotContains(t, redact.Text(msg), "s3cret")
	msg = `connect to NATS at nats://s3cret@127.0.0.1:4222: refused; also nats://n:s3cret@b:4222`
	require.Equal(t, `connect to NATS at nats://xxxxx@127.0.0.1:4222: refused; also nats://n:xxxxx@b:4222`, redact.Text(msg))
}
