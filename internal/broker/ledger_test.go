package broker_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// TestErasureLedgerRoles: with the embedded broker's real credentials, the
// erase role creates the source's erasure ledger and puts there; the
// projector role reads it (a running projector verifying a transaction
// with purged members) and may neither put there nor make the bucket; the
// erase role may make no other source's ledger.
func TestErasureLedgerRoles(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := startAuth(t, t.TempDir())
	connect := func(creds string) jetstream.JetStream {
		nc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(creds))
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		return js
	}
	cjs, pjs, ejs := connect(s.CaptureCreds()), connect(s.ProjectorCreds()), connect(s.EraseCreds())
	_, err := cjs.CreateStream(ctx, jetstream.StreamConfig{Name: "EPITAPH_MAIN", Subjects: []string{"epitaph.main.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)

	// erase --purge-stream's check, before it erases anything: the
	// projector role may neither make the ledger nor delete (refused as
	// ErrStreamDeniesDeletes, exit 3, after the probe's timeout, as the
	// server does not answer a request it refuses); the erase role may.
	// The projector's failed check leaves no ledger behind.
	err = erasure.CheckPurge(ctx, pjs, "main")
	require.ErrorIs(t, err, erasure.ErrStreamDeniesDeletes)
	require.Contains(t, err.Error(), "nothing was erased")

	// No ledger yet: the projector reads "nothing was purged".
	kv, err := erasure.OpenLedger(ctx, pjs, "main", false)
	require.NoError(t, err)
	require.Nil(t, kv)
	_, err = erasure.OpenLedger(short(t, ctx), pjs, "main", true)
	require.Error(t, err, "the projector making the ledger")

	ekv, err := erasure.OpenLedger(ctx, ejs, "main", true)
	require.NoError(t, err)
	st, err := ekv.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, event.ErasedBucket("main"), st.Bucket())
	require.Equal(t, "EPITAPH_MAIN_ERASED", st.Bucket())
	info := st.(*jetstream.KeyValueBucketStatus).StreamInfo()
	require.Equal(t, jetstream.FileStorage, info.Config.Storage)
	lsn := event.LSN(0x16B3748)
	sum := event.BodyHash([]byte(`{"v":1,"op":"delete"}`))
	entry := erasure.LedgerEntry{Stream: "EPITAPH_MAIN", StreamSeq: 7, CommitLSN: lsn, Seq: 3, BodySHA256: hex.EncodeToString(sum[:])}
	require.NoError(t, erasure.RecordErased(ctx, ekv, entry))
	again, err := erasure.OpenLedger(ctx, ejs, "main", true)
	require.NoError(t, err, "opening an existing ledger")

	pkv, err := erasure.OpenLedger(ctx, pjs, "main", false)
	require.NoError(t, err)
	require.NotNil(t, pkv)
	got, ok, err := erasure.LookupErased(ctx, pkv, lsn, 3)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, sum, got)
	_, ok, err = erasure.LookupErased(ctx, pkv, lsn, 4)
	require.NoError(t, err)
	require.False(t, ok, "no entry for another seq")
	_, err = pkv.Put(short(t, ctx), erasure.LedgerKey(lsn, 4), []byte(`{}`))
	require.Error(t, err, "the projector putting into the ledger")
	_, ok, err = erasure.LookupErased(ctx, again, lsn, 4)
	require.NoError(t, err)
	require.False(t, ok, "the projector's put was refused")

	require.NoError(t, erasure.CheckPurge(ctx, ejs, "main"), "the erase role, the ledger made")

	_, err = erasure.OpenLedger(short(t, ctx), ejs, "other", true)
	require.Error(t, err, "the erase role making another source's ledger")

	// An erased row's object, as erase --purge-stream removes it: the
	// capture wrote it; the erase role finds its chunks with an ordered
	// consumer of the object store's stream and securely deletes them and
	// its meta message, while the projector role may not.
	bucket := event.RowBucket("main")
	cobs, err := cjs.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: bucket, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = cobs.PutBytes(ctx, "row", bytes.Repeat([]byte("r"), 300_000))
	require.NoError(t, err)
	require.NoError(t, erasure.CheckPurge(ctx, ejs, "main"), "the erase role may delete objects' messages too")
	eobs, err := ejs.ObjectStore(ctx, bucket)
	require.NoError(t, err)
	oinfo, err := eobs.GetInfo(ctx, "row")
	require.NoError(t, err)
	ostream, err := ejs.Stream(ctx, "OBJ_"+bucket)
	require.NoError(t, err)
	cons, err := ostream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{"$O." + bucket + ".C." + oinfo.NUID}})
	require.NoError(t, err)
	batch, err := cons.Fetch(100, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	var seqs []uint64
	for m := range batch.Messages() {
		md, err := m.Metadata()
		require.NoError(t, err)
		seqs = append(seqs, md.Sequence.Stream)
	}
	require.Len(t, seqs, int(oinfo.Chunks))
	meta, err := ostream.GetLastMsgForSubject(ctx, "$O."+bucket+".M."+base64.URLEncoding.EncodeToString([]byte("row")))
	require.NoError(t, err)
	pstream, err := pjs.Stream(ctx, "OBJ_"+bucket)
	require.NoError(t, err)
	require.Error(t, pstream.SecureDeleteMsg(short(t, ctx), meta.Sequence), "the projector deleting an object's message")
	for _, seq := range append(seqs, meta.Sequence) {
		require.NoError(t, ostream.SecureDeleteMsg(ctx, seq))
	}
	_, err = eobs.GetInfo(ctx, "row")
	require.ErrorIs(t, err, jetstream.ErrObjectNotFound)
}
