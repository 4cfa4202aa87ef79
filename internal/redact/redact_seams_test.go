package redact

import (
	"strings"
	"testing"
)

// Credentials in forms the clients take are hidden too: a NATS server
// without its scheme (nats.go adds nats://), alone or in a list, a query
// parameter naming a password other than password= (sslpassword=, the
// passphrase of pgx's client key), and a postgres:// password with a
// character net/url does not take in userinfo ('#', '?', a space), which
// pgx reads up to the first '@'.
func TestURLHidesSchemelessUserinfoAndSSLPassword(t *testing.T) {
	for in, want := range map[string]string{
		"u:hunter2@127.0.0.1:4222":                    "u:xxxxx@127.0.0.1:4222",
		"hunter2@nats:4222":                           "xxxxx@nats:4222",
		"nats:4222,u:hunter2@nats2:4222":              "nats:4222,u:xxxxx@nats2:4222",
		"postgres://u@db/app?sslpassword=hunter2":     "postgres://u@db/app?sslpassword=xxxxx",
		"postgres://u:hunter2@db/app?sslmode=require": "postgres://u:xxxxx@db/app?sslmode=require",
		"nats://a:4222,nats://b:4222":                 "nats://a:4222,nats://b:4222",
		"host=db user=u password=hunter2 dbname=app":  "host=db user=u password=xxxxx dbname=app",
	} {
		got := URL(in)
		if got != want || strings.Contains(got, "hunter2") {
			t.Errorf("URL(%q) = %q, want %q", in, got, want)
		}
	}
}
