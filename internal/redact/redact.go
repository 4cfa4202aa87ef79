// Package redact hides secrets in connection strings and error texts before
// they reach a log line, an error message or a status page.
package redact

import (
	"net/url"
	"regexp"
	"strings"
)

// passwordRE matches a password keyword value (key=value DSNs, query
// parameters, server error texts).
var passwordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// urlPasswordRE matches the userinfo password of any URL inside a text.
var urlPasswordRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)\S*@`)

// natsTokenRE matches the userinfo of a NATS URL that has no password: a
// token (nats://TOKEN@host).
var natsTokenRE = regexp.MustCompile(`(?i)\b((?:nats|tls|ws|wss)://)[^:/@\s,]+@`)

// URL hides the password of a postgres:// or nats:// URL (userinfo or a
// query parameter naming a password: password=, sslpassword=), the token
// of a nats:// URL (nats://TOKEN@host), the userinfo of a NATS URL
// without its scheme (user:password@host:4222, which nats.go takes as
// nats://), or the password of a key=value connection string; a
// comma-separated list of NATS URLs has each hidden; any other text has
// every URL password, NATS token and password=value hidden.
func URL(s string) string {
	s = postgresUserinfo(s)
	if strings.Contains(s, ",") && (strings.Contains(s, "://") || strings.Contains(s, "@")) && !strings.ContainsAny(s, " \t") {
		parts := strings.Split(s, ",")
		for i, p := range parts {
			parts[i] = URL(p)
		}
		return strings.Join(parts, ",")
	}
	if !strings.Contains(s, "://") && strings.Contains(s, "@") && !strings.ContainsAny(s, " \t") {
		return strings.TrimPrefix(URL("nats://"+s), "nats://")
	}
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else if u.User != nil && isNATS(u.Scheme) {
			u.User = url.User("xxxxx")
		}
		q := u.Query()
		hidden := false
		for k := range q {
			if strings.Contains(strings.ToLower(k), "password") {
				q.Set(k, "xxxxx")
				hidden = true
			}
		}
		if hidden {
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return Text(s)
}

// postgresUserinfo hides the password of a postgres:// URL where pgx
// finds it: from the first ':' to the first '@' that comes before any '/'.
// A password pgx takes as written (an unencoded space, '#' or '?' in it)
// is not userinfo to net/url, which would leave it in the host, the
// fragment or the query, or not parse the URL at all.
func postgresUserinfo(s string) string {
	for _, prefix := range []string{"postgres://", "postgresql://"} {
		rest, ok := strings.CutPrefix(s, prefix)
		if !ok {
			continue
		}
		if i := strings.IndexAny(rest, "@/"); i >= 0 && rest[i] == '@' {
			if user, _, has := strings.Cut(rest[:i], ":"); has {
				return prefix + user + ":xxxxx" + rest[i:]
			}
		}
		return s
	}
	return s
}

// Text hides every URL password and password=value in a free text, such as
// an error message that quotes a connection string.
func Text(s string) string {
	s = urlPasswordRE.ReplaceAllString(s, "${1}xxxxx@")
	s = natsTokenRE.ReplaceAllString(s, "${1}xxxxx@")
	return passwordRE.ReplaceAllString(s, "${1}xxxxx")
}

func isNATS(scheme string) bool {
	switch strings.ToLower(scheme) {
	case "nats", "tls", "ws", "wss":
		return true
	}
	return false
}
