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
// password= query parameter), the token of a nats:// URL (nats://TOKEN@host),
// or the password of a key=value connection string; a comma-separated list
// of NATS URLs has each hidden; any other text has every URL password,
// NATS token and password=value hidden.
func URL(s string) string {
	if strings.Contains(s, ",") && strings.Contains(s, "://") && !strings.ContainsAny(s, " \t") {
		parts := strings.Split(s, ",")
		for i, p := range parts {
			parts[i] = URL(p)
		}
		return strings.Join(parts, ",")
	}
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else if u.User != nil && isNATS(u.Scheme) {
			u.User = url.User("xxxxx")
		}
		q := u.Query()
		if q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return Text(s)
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
