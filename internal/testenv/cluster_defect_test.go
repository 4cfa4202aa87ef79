package testenv_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestNATSDefectPlainChainAfterLeaderRestart reproduces, with nats-server
// alone, the open defect the cluster e2e test meets (deploy/README, "The
// JetStream cluster"): messages published like the capture's (plain NATS
// publishes without a reply subject, every 17th acknowledged, all chained by
// Nats-Expected-Last-Msg-Id; after a failure the chain resumes from the
// stream's last message), the stream leader's node stopped and started
// again: the restarted node stays at "stream write error: last msgid
// mismatch" and is never healthy again. Opt-in (EPITAPH_NATS_DEFECT_REPRO=1)
// while the server has the defect: it failed on nats-server v2.15.2 in
// every run and passed on v2.15.3 (3 of 3), where the capture's own load
// still finds the defect (deploy/README.md).
func TestNATSDefectPlainChainAfterLeaderRestart(t *testing.T) {
	if os.Getenv("EPITAPH_NATS_DEFECT_REPRO") != "1" {
		t.Skip("reproduces an open nats-server defect; set EPITAPH_NATS_DEFECT_REPRO=1 to run")
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	nc, err := nats.Connect(c.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	require.Eventually(t, func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err = js.CreateStream(cctx, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Storage: jetstream.FileStorage, Replicas: 3, Duplicates: 2 * time.Minute})
		return err == nil
	}, time.Minute, 250*time.Millisecond)
	stop := make(chan struct{})
	done := make(chan int)
	go func() {
		last, i := "", 0
		for {
			select {
			case <-stop:
				done <- i
				return
			default:
			}
			// 16 plain messages, then one acked, chained by expected last msg id
			ok := true
			prev := last
			for k := 0; k < 17 && ok; k++ {
				id := fmt.Sprintf("m%d", i+k)
				m := nats.NewMsg(fmt.Sprintf("r3.%d", k%4))
				m.Data = []byte(id)
				m.Header.Set(jetstream.MsgIDHeader, id)
				if prev != "" {
					m.Header.Set(jetstream.ExpectedLastMsgIDHeader, prev)
				}
				if k < 16 {
					if err := nc.PublishMsg(m); err != nil {
						ok = false
					}
				} else {
					cctx, cc := context.WithTimeout(ctx, 2*time.Second)
					_, err := js.PublishMsg(cctx, m)
					cc()
					if err != nil {
						ok = false
					}
				}
				prev = id
			}
			if ok {
				last = prev
				i += 17
			} else {
				// like the capture after a failure: find the stream's last id
				time.Sleep(200 * time.Millisecond)
				cctx, cc := context.WithTimeout(ctx, 2*time.Second)
				s, err := js.Stream(cctx, "R3")
				if err == nil {
					if info, err := s.Info(cctx); err == nil && info.State.LastSeq > 0 {
						if m, err := s.GetMsg(cctx, info.State.LastSeq); err == nil {
							last = m.Header.Get(jetstream.MsgIDHeader)
							_, _ = fmt.Sscanf(last, "m%d", &i)
							i++
						}
					}
				}
				cc()
			}
		}
	}()
	time.Sleep(2 * time.Second)
	l, _, err := testenv.StreamCluster(ctx, js, "R3")
	require.NoError(t, err)
	f := c.Node(l)
	f.Stop()
	time.Sleep(2 * time.Second)
	f.Start()
	err = c.WaitHealthy(ctx, 30*time.Second)
	close(stop)
	t.Logf("published %d", <-done)
	require.NoError(t, err)
}

// TestNATSDefectOneWrongExpectedLastMsgIDWedgesTheStream reproduces, with
// nats-server alone, the root of the defect above: one publish whose
// Nats-Expected-Last-Msg-Id is not the stream's last id, to a stream of
// three replicas, is refused ("wrong last msg ID") when it is applied, and
// every replica stops at "stream write error: last msgid mismatch": no
// leader, nothing stored again. A single server refuses it and goes on.
// Opt-in (EPITAPH_NATS_DEFECT_REPRO=1) while the server has the defect: on
// nats-server v2.15.3 it fails in every run.
func TestNATSDefectOneWrongExpectedLastMsgIDWedgesTheStream(t *testing.T) {
	if os.Getenv("EPITAPH_NATS_DEFECT_REPRO") != "1" {
		t.Skip("reproduces an open nats-server defect; set EPITAPH_NATS_DEFECT_REPRO=1 to run")
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	nc, err := nats.Connect(c.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	require.Eventually(t, func() bool {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err = js.CreateStream(cctx, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Storage: jetstream.FileStorage, Replicas: 3})
		return err == nil
	}, time.Minute, 250*time.Millisecond)
	_, err = js.Publish(ctx, "r3.a", []byte("1"), jetstream.WithMsgID("a"))
	require.NoError(t, err)
	m := nats.NewMsg("r3.b")
	m.Header.Set(jetstream.ExpectedLastMsgIDHeader, "not-the-last")
	_, err = js.PublishMsg(ctx, m)
	var apiErr *jetstream.APIError
	require.ErrorAs(t, err, &apiErr)
	require.Equal(t, jetstream.ErrorCode(10070), apiErr.ErrorCode, "wrong last msg ID")
	require.Eventually(t, func() bool {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.Publish(cctx, "r3.c", []byte("2"))
		if err != nil {
			t.Logf("publish after the refusal: %v", err)
		}
		return err == nil
	}, 30*time.Second, 500*time.Millisecond, "the stream stores again after one refused publish")
}
