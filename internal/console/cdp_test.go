package console_test

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// browser is a real headless chromium driven over its DevTools pipe
// (--remote-debugging-pipe: JSON messages ended by NUL on fds 3 and 4),
// so a test can type into the console, click its buttons and read what
// the page shows, as a person would.
type browser struct {
	t       *testing.T
	cmd     *exec.Cmd
	mu      sync.Mutex
	w       *os.File
	r       *bufio.Reader
	id      int
	session string
	// password answers the console's Basic authentication challenge, as
	// a person types the token into the browser's own login prompt.
	password string
	aux      int
}

// chromium returns the path of Debian's chromium, failing the test (never
// skipping) when it is not installed.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("chromium is not installed: the console is tested in a real headless browser; run `apt-get install -y chromium`")
	return ""
}

func newBrowser(t *testing.T, password string) *browser {
	t.Helper()
	toChrome, ours, err := os.Pipe()
	require.NoError(t, err)
	theirs, fromChrome, err := os.Pipe()
	require.NoError(t, err)
	cmd := exec.Command(chromium(t), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--hide-scrollbars", "--user-data-dir="+t.TempDir(), "--window-size=1280,900", "--remote-debugging-pipe", "about:blank")
	cmd.ExtraFiles = []*os.File{toChrome, fromChrome} // fds 3 and 4
	require.NoError(t, cmd.Start())
	_ = toChrome.Close()
	_ = fromChrome.Close()
	b := &browser{t: t, cmd: cmd, w: ours, r: bufio.NewReader(theirs), password: password, aux: 1 << 30}
	t.Cleanup(func() {
		_ = ours.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = theirs.Close()
	})
	var created struct{ TargetID string }
	b.call("Target.createTarget", map[string]any{"url": "about:blank"}, &created)
	var attached struct{ SessionID string }
	b.call("Target.attachToTarget", map[string]any{"targetId": created.TargetID, "flatten": true}, &attached)
	b.session = attached.SessionID
	b.call("Page.enable", nil, nil)
	b.call("Runtime.enable", nil, nil)
	b.call("Fetch.enable", map[string]any{"handleAuthRequests": true, "patterns": []map[string]any{{"urlPattern": "*"}}}, nil)
	return b
}

// call sends one DevTools command (on the page's session once attached)
// and decodes its result into out.
func (b *browser) call(method string, params any, out any) {
	b.t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.id++
	msg := map[string]any{"id": b.id, "method": method}
	if params != nil {
		msg["params"] = params
	}
	if b.session != "" {
		msg["sessionId"] = b.session
	}
	data, err := json.Marshal(msg)
	require.NoError(b.t, err)
	_, err = b.w.Write(append(data, 0))
	require.NoError(b.t, err)
	done := make(chan error, 1)
	var res struct {
		ID     int             `json:"id"`
		Result json.RawMessage `json:"result"`
		Error  *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	go func() {
		for {
			line, err := b.r.ReadBytes(0)
			if err != nil {
				done <- err
				return
			}
			res.ID, res.Result, res.Error = 0, nil, nil
			if json.Unmarshal(line[:len(line)-1], &res) == nil && res.ID == b.id {
				done <- nil
				return
			}
			if err := b.onEvent(line[:len(line)-1]); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		require.NoError(b.t, err, "chromium: %s", method)
	case <-time.After(60 * time.Second):
		b.t.Fatalf("chromium: %s did not answer in 60s", method)
	}
	require.Nil(b.t, res.Error, "chromium: %s", method)
	if out != nil {
		require.NoError(b.t, json.Unmarshal(res.Result, out))
	}
}

// onEvent lets paused requests go on and answers authentication
// challenges with the password (called by call's reader only, while call
// waits, so writes do not interleave).
func (b *browser) onEvent(msg []byte) error {
	var ev struct {
		Method    string `json:"method"`
		SessionID string `json:"sessionId"`
		Params    struct {
			RequestID string `json:"requestId"`
		} `json:"params"`
	}
	if json.Unmarshal(msg, &ev) != nil {
		return nil
	}
	var reply map[string]any
	switch ev.Method {
	case "Fetch.requestPaused":
		reply = map[string]any{"method": "Fetch.continueRequest", "params": map[string]any{"requestId": ev.Params.RequestID}}
	case "Fetch.authRequired":
		reply = map[string]any{"method": "Fetch.continueWithAuth", "params": map[string]any{"requestId": ev.Params.RequestID,
			"authChallengeResponse": map[string]any{"response": "ProvideCredentials", "username": "support", "password": b.password}}}
	default:
		return nil
	}
	b.aux++
	reply["id"], reply["sessionId"] = b.aux, ev.SessionID
	data, err := json.Marshal(reply)
	if err != nil {
		return err
	}
	_, err = b.w.Write(append(data, 0))
	return err
}

// eval runs JavaScript in the page (awaiting a promise) and returns its
// value as JSON.
func (b *browser) eval(js string) json.RawMessage {
	b.t.Helper()
	var res struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	b.call("Runtime.evaluate", map[string]any{"expression": js, "returnByValue": true, "awaitPromise": true}, &res)
	if res.ExceptionDetails != nil {
		b.t.Fatalf("javascript %q: %s %s", js, res.ExceptionDetails.Text, res.ExceptionDetails.Exception.Description)
	}
	return res.Result.Value
}

// text is document.body.innerText (what a reader sees, markup as text).
func (b *browser) text() string {
	var s string
	require.NoError(b.t, json.Unmarshal(b.eval(`document.body ? document.body.innerText : ""`), &s))
	return s
}

// open navigates and waits until the page is loaded.
func (b *browser) open(url string) {
	b.t.Helper()
	b.call("Page.navigate", map[string]any{"url": url}, nil)
	b.waitFor(fmt.Sprintf(`document.readyState === "complete" && location.href === %q`, url), "%s loads", url)
}

// waitFor polls a JavaScript condition until it is true.
func (b *browser) waitFor(cond string, what string, args ...any) {
	b.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		if string(b.eval("!!("+cond+")")) == "true" {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("waiting for %s: %s is still false; the page says:\n%s", fmt.Sprintf(what, args...), cond, b.text())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// click clicks the element with data-testid id.
func (b *browser) click(id string) {
	b.t.Helper()
	b.waitFor(fmt.Sprintf(`(function(){var e=document.querySelector('[data-testid=%q]'); return e && !e.disabled && !e.hidden})()`, id), "%s clickable", id)
	b.eval(fmt.Sprintf(`document.querySelector('[data-testid=%q]').click()`, id))
}

// typeInto sets an input's value as typing would.
func (b *browser) typeInto(selector, value string) {
	b.t.Helper()
	v, _ := json.Marshal(value)
	b.eval(fmt.Sprintf(`(function(){var e=document.querySelector(%q); e.value=%s; e.dispatchEvent(new Event("input"))})()`, selector, v))
}

// textOf is the innerText of the element with data-testid id.
func (b *browser) textOf(id string) string {
	var s string
	require.NoError(b.t, json.Unmarshal(b.eval(fmt.Sprintf(`(function(){var e=document.querySelector('[data-testid=%q]'); return e ? e.innerText : ""})()`, id)), &s))
	return s
}

// screenshot saves the viewport as a PNG, checks it is a real page and
// small, and copies it to $EPITAPH_CONSOLE_SCREENSHOT_DIR when set (how
// docs/images is made).
func (b *browser) screenshot(name string) {
	b.t.Helper()
	var res struct{ Data string }
	b.call("Page.captureScreenshot", map[string]any{"format": "png"}, &res)
	data, err := base64.StdEncoding.DecodeString(res.Data)
	require.NoError(b.t, err)
	img, err := png.Decode(strings.NewReader(string(data)))
	require.NoError(b.t, err)
	colours := map[uint32]bool{}
	bd := img.Bounds()
	for y := bd.Min.Y; y < bd.Max.Y; y += 3 {
		for x := bd.Min.X; x < bd.Max.X; x += 3 {
			r, g, bl, _ := img.At(x, y).RGBA()
			colours[r>>8<<16|g>>8<<8|bl>>8] = true
		}
	}
	require.Greater(b.t, len(colours), 20, "screenshot %s looks blank", name)
	require.Less(b.t, len(data), 200<<10, "screenshot %s is over 200 KB", name)
	if dir := os.Getenv("EPITAPH_CONSOLE_SCREENSHOT_DIR"); dir != "" {
		require.NoError(b.t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
	}
	b.t.Logf("screenshot %s: %d bytes, %d colours", name, len(data), len(colours))
}
