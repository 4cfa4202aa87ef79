// Package httptoken is the bearer token that guards the projector's HTTP
// actions (--http-token-file): read once from a file an operator keeps
// private, compared in constant time, never printed.
//
// A request carries the token in its Authorization header ("Bearer
// <token>"), never in a cookie or a query parameter, so a page of another
// origin cannot make a browser send it (no CSRF) and it stays out of
// access logs.
package httptoken

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"strings"
)

// minLength is the shortest token accepted: shorter ones can be guessed.
const minLength = 16

// Token is a loaded bearer token. Its zero value and nil match nothing.
// It formats as "[redacted]" so it cannot end up in a log by accident.
type Token struct {
	sum [sha256.Size]byte
	set bool
}

// Load reads the token from path: the file's content without surrounding
// white space. It refuses, with one clear line, a file that is missing,
// empty, shorter than 16 characters, or readable by every user of the
// machine (mode o+r: chmod 600 it). The error never contains the token.
func Load(path string) (*Token, error) {
	if path == "" {
		return nil, errors.New("--http-token-file: no file given")
	}
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("--http-token-file %s: no such file", path)
	}
	if err != nil {
		return nil, fmt.Errorf("--http-token-file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("--http-token-file %s: not a regular file", path)
	}
	if fi.Mode().Perm()&0o004 != 0 {
		return nil, fmt.Errorf("--http-token-file %s: readable by every user (mode %04o): chmod 600 it", path, fi.Mode().Perm())
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--http-token-file: %w", err)
	}
	tok := strings.TrimSpace(string(raw))
	switch {
	case tok == "":
		return nil, fmt.Errorf("--http-token-file %s is empty", path)
	case len(tok) < minLength:
		return nil, fmt.Errorf("--http-token-file %s: the token is shorter than %d characters", path, minLength)
	case strings.ContainsAny(tok, " \t\r\n"):
		return nil, fmt.Errorf("--http-token-file %s: the token contains white space (one line, one token)", path)
	}
	return &Token{sum: sha256.Sum256([]byte(tok)), set: true}, nil
}

// Check reports whether r carries the token in "Authorization: Bearer
// <token>". The comparison takes the same time whatever the header holds
// (both sides are hashed first, so not even the length leaks). A nil
// token matches nothing.
func (t *Token) Check(r *http.Request) bool {
	if t == nil || !t.set {
		return false
	}
	h := r.Header.Get("Authorization")
	scheme, given, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(given)))
	return subtle.ConstantTimeCompare(sum[:], t.sum[:]) == 1
}

// String hides the token.
func (t *Token) String() string { return "[redacted]" }

// GoString hides the token from %#v.
func (t *Token) GoString() string { return "[redacted]" }

// LoopbackHost reports whether r is addressed to a loopback host: its Host
// is localhost or a loopback IP address (127.0.0.0/8, ::1), with or without
// a port. Without a token the projector's HTTP address is on loopback only,
// yet a browser reaches it under any name that resolves there, and lets
// that name's pages read the answers (DNS rebinding): such a request names
// another host, so an open endpoint answers only requests for which
// LoopbackHost is true.
func LoopbackHost(r *http.Request) bool {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1] // an IPv6 literal without a port
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// LoopbackOnly is the answer's text for a request LoopbackHost refuses.
const LoopbackOnly = "without --http-token-file only requests for localhost or a loopback address (127.0.0.1, [::1]) are answered: use one of those, or set a token"
