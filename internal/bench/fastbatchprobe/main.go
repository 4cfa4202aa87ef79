// Command fastbatchprobe compares, in one process against an in-process
// nats-server (file storage, persist mode default), the capture's publish
// scheme (core publishes, every 64th asking for an acknowledgement, each
// expecting its predecessor's message id) with JetStream 2.12+ fast batch
// publishing (reply subject <prefix>.<id>.<flow>.fail.<seq>.<op>.$FI, the
// server acknowledging every <flow> messages). It prints wall time and
// process CPU seconds per message of each.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func cpu() float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

func main() {
	n := flag.Int("n", 200_000, "messages per scheme")
	rounds := flag.Int("rounds", 2, "rounds")
	flag.Parse()
	dir, _ := os.MkdirTemp("", "fastbatchprobe-")
	defer os.RemoveAll(dir)
	ns, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, Port: -1, NoLog: true, NoSigs: true})
	if err != nil {
		log.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		log.Fatal("not ready")
	}
	defer ns.Shutdown()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	body := []byte(strings.Repeat("x", 300))
	for r := 1; r <= *rounds; r++ {
		for _, scheme := range []string{"capture", "fastbatch"} {
			ctx := context.Background()
			name := fmt.Sprintf("S%s%d", scheme, r)
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.FileStorage,
				AllowBatchPublish: true, Duplicates: 2 * time.Minute}); err != nil {
				log.Fatal(err)
			}
			c0, t0 := cpu(), time.Now()
			if scheme == "capture" {
				err = captureScheme(js, nc, name, body, *n)
			} else {
				err = fastBatch(nc, name, body, *n)
			}
			if err != nil {
				log.Fatalf("%s: %v", scheme, err)
			}
			took, c := time.Since(t0), cpu()-c0
			s, _ := js.Stream(ctx, name)
			info, _ := s.Info(ctx)
			fmt.Printf("round %d %-9s %d msgs stored %d: %.2f s, %.0f msgs/s, %.2f µs CPU/msg (client+server)\n", r, scheme, *n, info.State.Msgs, took.Seconds(), float64(*n)/took.Seconds(), c*1e6/float64(*n))
		}
	}
}

func hdr(name string, i int, last string) nats.Header {
	id := fmt.Sprintf("main/0/%X/%d/t0123456789abcdef", 0x1000000+i/700, i%700)
	h := nats.Header{"Epitaph-Version": {"1"}, "Epitaph-Position": {fmt.Sprintf("0/%X#%d", 0x1000000+i/700, i%700)}, "Nats-Msg-Id": {id}, "Epitaph-Partition-Seq": {strconv.Itoa(i + 1)}}
	if last != "" {
		h["Nats-Expected-Last-Msg-Id"] = []string{last}
	}
	return h
}

func captureScheme(js jetstream.JetStream, nc *nats.Conn, name string, body []byte, n int) error {
	last := ""
	var futs []jetstream.PubAckFuture
	for i := 0; i < n; i++ {
		h := hdr(name, i, last)
		m := &nats.Msg{Subject: name + ".p1.delete.public.t", Data: body, Header: h}
		if i%64 == 63 || i == n-1 {
			f, err := js.PublishMsgAsync(m, jetstream.WithRetryAttempts(0))
			if err != nil {
				return err
			}
			futs = append(futs, f)
			for len(futs) > 64 {
				select {
				case <-futs[0].Ok():
				case err := <-futs[0].Err():
					return err
				}
				futs = futs[1:]
			}
		} else if err := nc.PublishMsg(m); err != nil {
			return err
		}
		last = h.Get("Nats-Msg-Id")
	}
	for _, f := range futs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return err
		}
	}
	return nil
}

// fastBatch publishes n messages as one fast batch with flow control 500
// (at most two windows un-acknowledged), committing with the last.
func fastBatch(nc *nats.Conn, name string, body []byte, n int) error {
	id := nats.NewInbox()[len("_INBOX."):]
	prefix := "_FB." + id
	acked := make(chan uint64, 1024)
	sub, err := nc.Subscribe(prefix+".>", func(m *nats.Msg) {
		s := string(m.Data)
		if i := strings.Index(s, `"seq":`); i >= 0 {
			v, _ := strconv.ParseUint(strings.Trim(strings.SplitN(s[i+6:], ",", 2)[0], "} "), 10, 64)
			acked <- v
		} else {
			acked <- 0
		}
	})
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	var ack uint64
	last := ""
	for i := 0; i < n; i++ {
		op := batchOp(i, n)
		for uint64(i) > ack+1000 {
			select {
			case a := <-acked:
				ack = max(ack, a)
			case <-time.After(10 * time.Second):
				return fmt.Errorf("no flow ack after %d", ack)
			}
		}
		h := hdr(name, i, last)
		m := &nats.Msg{Subject: name + ".p1.delete.public.t", Reply: fmt.Sprintf("%s.500.fail.%d.%d.$FI", prefix, i+1, op), Data: body, Header: h}
		if err := nc.PublishMsg(m); err != nil {
			return err
		}
		last = h.Get("Nats-Msg-Id")
	}
	deadline := time.After(30 * time.Second)
	for {
		select {
		case a := <-acked:
			if a >= uint64(n) {
				return nil
			}
			ack = max(ack, a)
		case <-deadline:
			return fmt.Errorf("commit not acknowledged (last %d)", ack)
		}
	}
}

// batchOp is the fast batch operation of message i of n: start, append or
// commit.
func batchOp(i, n int) int {
	if i == n-1 {
		return 2
	}
	return min(i, 1)
}
