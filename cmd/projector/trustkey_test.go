package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The trust-key flow through the real binary: the first key is trusted on
// first use (shown by --show), a transaction signed by another key is
// quarantined as unauthenticated until `trust-key --key-file` adds that key,
// after which what it signs is archived and both keys are listed.
func TestTrustKeyFlow(t *testing.T) {
	t.Parallel()
	bin, url, n, js := startTarget(t, 1)
	ctx := context.Background()
	env := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=trust-1", "EPITAPH_LEASE_TTL=2s", "EPITAPH_METRICS_ADDR=127.0.0.1:0")

	out, err := runBin(bin, env, "trust-key", "--show")
	require.NoError(t, err, out)
	require.Contains(t, out, "trusted keys: none yet")
	out, err = runBin(bin, env, "trust-key", "--key-file", filepath.Join(t.TempDir(), "missing.pub"))
	require.Error(t, err)
	require.Contains(t, out, "read key file")
	bad := filepath.Join(t.TempDir(), "bad.pub")
	require.NoError(t, os.WriteFile(bad, []byte("not a key\n"), 0o644))
	out, err = runBin(bin, env, "trust-key", "--key-file", bad)
	require.Error(t, err)
	require.Contains(t, out, "parse public key")

	cmd := exec.Command(bin, "run")
	cmd.Env = env
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	waitFor := func(sql string, want int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			var got int
			if err := conn.QueryRow(ctx, sql).Scan(&got); err == nil && got == want {
				return
			}
			require.True(t, time.Now().Before(deadline), "%s: want %d\n%s", sql, want, logs.String())
			time.Sleep(50 * time.Millisecond)
		}
	}

	first := signerFor(js)
	lsn := event.LSN(0x5000000)
	publishTx(t, js, 0, lsn, 1)
	waitFor(`SELECT count(*) FROM archive.rows`, 1)

	rotated := testenv.NewSigner()
	publishWith := func(s *testenv.Signer, lsn event.LSN, id int) {
		for _, m := range txMessages(t, lsn, id) {
			s.Sign(m)
			_, err := js.PublishMsg(ctx, m)
			require.NoError(t, err)
		}
	}
	publishWith(rotated, lsn+0x100, 2)
	// The commit at once; its row when the next verified commit settles it.
	waitFor(`SELECT count(*) FROM epitaph.quarantine WHERE category = 'unauthenticated'`, 1)
	require.Contains(t, logs.String(), event.KeyID(rotated.Public()))

	pubFile := filepath.Join(t.TempDir(), "signing.pub")
	require.NoError(t, event.WritePublicKey(pubFile, rotated.Public()))
	out, err = runBin(bin, env, "trust-key", "--key-file", pubFile, "--note", "capture moved hosts")
	require.NoError(t, err, out)
	require.Contains(t, out, "trusted key "+event.KeyID(rotated.Public()))
	out, err = runBin(bin, env, "trust-key", "--key", event.PublicKeyString(rotated.Public()))
	require.NoError(t, err, out)
	require.Contains(t, out, "is trusted already")

	publishWith(rotated, lsn+0x200, 3)
	publishTx(t, js, 0, lsn+0x300, 4) // the first key still signs
	waitFor(`SELECT count(*) FROM archive.rows`, 3)
	waitFor(`SELECT count(*) FROM epitaph.quarantine WHERE category = 'unauthenticated'`, 2)
	var keys []int
	require.NoError(t, pgxCollect(ctx, conn, `SELECT (key->>'id')::int FROM archive.rows ORDER BY commit_lsn`, &keys))
	require.Equal(t, []int{1, 3, 4}, keys)

	out, err = runBin(bin, env, "trust-key", "--show", "--json")
	require.NoError(t, err, out)
	var shown struct {
		Keys []struct {
			KeyID     string `json:"key_id"`
			PublicKey string `json:"public_key"`
			TrustedBy string `json:"trusted_by"`
			Note      string `json:"note"`
		} `json:"trusted_keys"`
		Bounds []struct {
			Partition   int    `json:"partition"`
			BoundarySeq uint64 `json:"boundary_seq"`
		} `json:"legacy_boundaries"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &shown), out)
	require.Len(t, shown.Keys, 2)
	require.Equal(t, event.KeyID(first.Public()), shown.Keys[0].KeyID)
	require.Equal(t, "first use", shown.Keys[0].TrustedBy)
	require.Equal(t, event.KeyID(rotated.Public()), shown.Keys[1].KeyID)
	require.Equal(t, event.PublicKeyString(rotated.Public()), shown.Keys[1].PublicKey)
	require.Equal(t, "capture moved hosts", shown.Keys[1].Note)
	require.Empty(t, shown.Bounds, "no legacy boundary is inferred")
	out, err = runBin(bin, env, "trust-key")
	require.NoError(t, err, out)
	require.Contains(t, out, event.KeyID(rotated.Public())+"  "+event.PublicKeyString(rotated.Public()))
	require.Contains(t, out, "legacy boundaries: none recorded yet")
}

// txMessages is publishTx's one-row transaction, unsigned and unpublished.
func txMessages(t *testing.T, lsn event.LSN, orderID int) []*nats.Msg {
	t.Helper()
	now := time.Now().UTC()
	var out []*nats.Msg
	add := func(subject, id string, ev *event.Event) {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		out = append(out, m)
	}
	add(event.DeleteSubject("main", 0, "public", "orders"), event.MsgID("main", lsn, 0), &event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: int64(orderID), CommitLSN: lsn,
		CommitTime: now, Identity: event.IdentityFull, Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, orderID)),
		Row: json.RawMessage(fmt.Sprintf(`{"id":%d,"total":"1.50"}`, orderID))})
	add(event.CommitSubject("main", 0), event.CommitMsgID("main", lsn), &event.Event{
		Op: event.OpCommit, Source: "main", XID: int64(orderID), CommitLSN: lsn, CommitTime: now, Rows: 1,
		Tables: map[string]int{"public.orders": 1}})
	return out
}

func pgxCollect(ctx context.Context, conn *pgx.Conn, sql string, dst *[]int) error {
	rows, err := conn.Query(ctx, sql)
	if err != nil {
		return err
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[int])
	*dst = got
	return err
}

// trust-key --legacy-boundary records boundaries an operator vouches for:
// "last" the stream's last sequence for every partition, P=SEQ the given
// ones; a malformed spec or a partition the stream does not have is a
// usage error that records nothing.
func TestTrustKeyLegacyBoundary(t *testing.T) {
	t.Parallel()
	bin, url, n, js := startTarget(t, 2)
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		_, err := js.Publish(ctx, event.CommitSubject("main", i%2), []byte(`{}`))
		require.NoError(t, err)
	}
	env := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+n.URL)
	bounds := func() []string {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer conn.Close(ctx)
		rows, err := conn.Query(ctx, `SELECT stream || ' ' || partition || ' ' || boundary_seq FROM epitaph.legacy_boundaries ORDER BY partition`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	for _, bad := range []string{"x", "0=", "0=1,0=2", "-1=3", "2=1"} {
		out, err := runBin(bin, env, "trust-key", "--legacy-boundary", bad)
		require.Error(t, err, bad)
		require.Contains(t, out, "--legacy-boundary", bad)
	}
	out, err := runBin(bin, env, "trust-key", "--show")
	require.NoError(t, err, out)
	require.Empty(t, bounds())
	out, err = runBin(bin, env, "trust-key", "--legacy-boundary", "last")
	require.NoError(t, err, out)
	require.Contains(t, out, "partition 1: sequence 3")
	require.Equal(t, []string{"EPITAPH_MAIN 0 3", "EPITAPH_MAIN 1 3"}, bounds())
	out, err = runBin(bin, env, "trust-key", "--legacy-boundary", "1=2")
	require.NoError(t, err, out)
	require.Equal(t, []string{"EPITAPH_MAIN 0 3", "EPITAPH_MAIN 1 2"}, bounds())
}
