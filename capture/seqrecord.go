package capture

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/epitaph-dev/epitaph/event"
)

// The partition sequences are kept outside the stream too. Read from the
// stream alone, a start would take each partition's sequence from the last
// own message still stored: messages deleted from the tail (a holder of a
// credential allowed to delete messages, a limit) would be numbered again,
// and a reader that had not applied them would see the sequence continue
// and never learn they existed. So, along with every confirmation of the
// slot's position (sendStatus, before the standby status update), the
// capture records every partition's last acknowledged signed message's
// sequence (tracker.safeSeqs) in two places:
//   - its data dir, seqFile, replaced atomically;
//   - the source, seqTable, a table of Epitaph's own schema, so a standby
//     capture taking over and a capture whose data dir was lost stay right.
//
// A start takes, per partition, the highest of the stream's, the file's
// and the table's: a removed tail becomes a jump in the partition's
// sequence, which readers record as a gap. Neither record ever goes back.

// seqFile is the data dir's record, one per source.
func seqFile(dataDir, source string) string {
	return filepath.Join(dataDir, "partition-seqs."+source+".json")
}

// seqTable is the source's record.
const seqTable = "epitaph.capture_partition_seqs"

const sqlSeqTable = `CREATE TABLE IF NOT EXISTS ` + seqTable + ` (
  stream        text        NOT NULL,
  partition     int         NOT NULL,
  seq           bigint      NOT NULL,
  confirmed_lsn pg_lsn      NOT NULL,
  updated_at    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (stream, partition)
)`

// slotPosPartition is the row of seqTable, per stream, whose
// confirmed_lsn is the highest position the capture confirmed to its slot
// (recorded before every confirmation) and whose seq is the highest
// timeline of the source it streamed from (recorded at every session's
// start, before anything is published; timeline.go). A partition's
// row records its confirmed_lsn only when its sequence moves, and captures
// older than this row wrote none: a start compares the slot's confirmed
// position with it only where it exists (slotPastRecord).
const slotPosPartition = -1

// sqlSeqRecord raises the recorded sequences ($2, indexed by partition
// from 0) of stream $1, and the confirmed position $3 and timeline $4
// (slotPosPartition); a lower one (a standby with an older view) never
// lowers them.
const sqlSeqRecord = `INSERT INTO ` + seqTable + ` AS r (stream, partition, seq, confirmed_lsn)
SELECT $1, u.p - 1, u.s, $3::pg_lsn FROM unnest($2::bigint[]) WITH ORDINALITY AS u(s, p) WHERE u.s > 0
UNION ALL SELECT $1, -1, $4::bigint, $3::pg_lsn
ON CONFLICT (stream, partition) DO UPDATE SET seq = greatest(r.seq, excluded.seq),
  confirmed_lsn = greatest(r.confirmed_lsn, excluded.confirmed_lsn), updated_at = now()
WHERE excluded.seq > r.seq OR excluded.confirmed_lsn > r.confirmed_lsn`

// seqFileBody is seqFile's content.
type seqFileBody struct {
	Stream       string   `json:"stream"`
	ConfirmedLSN string   `json:"confirmed_lsn"`
	Seqs         []uint64 `json:"seqs"`
}

// seqRecords are the sequences recorded outside the stream, read at a
// session's start.
type seqRecords struct {
	file, source []uint64
	// slotLSN is the highest position recorded as confirmed to the slot:
	// the source's slotPosPartition row, raised to the data dir's record
	// (0: the source has no such row).
	slotLSN event.LSN
	// timeline is the source's timeline recorded with it (0: none).
	timeline int32
}

// ensureSeqTable makes the source's record if it is missing. A source
// where it cannot be made (a role without CREATE on the database, a
// standby) is left without it, with a warning: the data dir's record
// still holds.
func (s *Service) ensureSeqTable(ctx context.Context) {
	var exists bool
	err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, seqTable).Scan(&exists)
	if err == nil && !exists {
		_, err = s.pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS epitaph; `+sqlSeqTable)
	}
	if err == nil {
		// Made by another role (a first run as a superuser, say).
		var read, write bool
		if read, write, err = tablePrivileges(ctx, s.pool, seqTable, "INSERT", "UPDATE", "DELETE"); err == nil && !(read && write) {
			err = errors.New("permission denied: grant SELECT, INSERT, UPDATE, DELETE ON " + seqTable + " to the capture's role")
		}
	}
	if err != nil {
		s.seqTableOK.Store(false)
		s.log.Warn("cannot keep the partition sequences on the source (only in the data dir): a standby capture, or this one with its data dir lost, would number again messages removed from the stream's tail",
			"table", seqTable, "err", redactErr(err))
		return
	}
	s.seqTableOK.Store(true)
}

// readSeqRecords reads both records of the configured source (missing:
// none).
func (s *Service) readSeqRecords(ctx context.Context) (seqRecords, error) {
	var r seqRecords
	var fileLSN event.LSN
	stream := event.StreamName(s.cfg.SourceName)
	if s.cfg.DataDir != "" {
		path := seqFile(s.cfg.DataDir, s.cfg.SourceName)
		b, err := os.ReadFile(path)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			return r, fmt.Errorf("read the partition sequences recorded in %s: %w", path, err)
		default:
			var body seqFileBody
			if err := json.Unmarshal(b, &body); err != nil {
				return r, fmt.Errorf("read the partition sequences recorded in %s: %w (remove the file to rely on the stream and the source's record)", path, err)
			}
			if body.Stream == stream {
				r.file = body.Seqs
				fileLSN, _ = event.ParseLSN(body.ConfirmedLSN)
			}
		}
	}
	if s.seqTableOK.Load() {
		rows, err := s.pool.Query(ctx, `SELECT partition, seq, confirmed_lsn::text FROM `+seqTable+` WHERE stream = $1`, stream)
		if err != nil {
			return r, fmt.Errorf("read the partition sequences recorded in %s: %s", seqTable, redactErr(err))
		}
		defer rows.Close()
		for rows.Next() {
			var p int
			var seq int64
			var lsn string
			if err := rows.Scan(&p, &seq, &lsn); err != nil {
				return r, fmt.Errorf("read the partition sequences recorded in %s: %w", seqTable, err)
			}
			if p == slotPosPartition {
				if r.slotLSN, err = event.ParseLSN(lsn); err != nil {
					return r, fmt.Errorf("read the confirmed position recorded in %s: %w", seqTable, err)
				}
				r.slotLSN, r.timeline = max(r.slotLSN, fileLSN), int32(seq)
				continue
			}
			if p < 0 || seq <= 0 {
				continue
			}
			for len(r.source) <= p {
				r.source = append(r.source, 0)
			}
			r.source[p] = uint64(seq)
		}
		if err := rows.Err(); err != nil {
			return r, fmt.Errorf("read the partition sequences recorded in %s: %s", seqTable, redactErr(err))
		}
	}
	return r, nil
}

// seqs is the highest of both records per partition (parts of them).
func (r seqRecords) seqs(parts int) []uint64 {
	out := make([]uint64, parts)
	for p := range out {
		if p < len(r.file) {
			out[p] = r.file[p]
		}
		if p < len(r.source) {
			out[p] = max(out[p], r.source[p])
		}
	}
	return out
}

// raiseSeqs raises the stream's partition sequences (partSeq) to the
// records, logging and counting every partition whose stored messages end
// below what the capture recorded as published: those messages were
// removed from the stream, and the next one of the partition carries the
// sequence after them.
func (s *Service) raiseSeqs(partSeq []uint64, r seqRecords) {
	for p := range partSeq {
		rec, from := uint64(0), ""
		if p < len(r.file) && r.file[p] > rec {
			rec, from = r.file[p], "data dir"
		}
		if p < len(r.source) && r.source[p] > rec {
			rec, from = r.source[p], "source"
		}
		if rec <= partSeq[p] {
			continue
		}
		s.m.tailRemoved.Inc()
		s.log.Warn("partition's last messages are missing from the stream: continuing after the last sequence the capture recorded as published, so readers record the missing ones as a gap",
			"partition", p, "stream_last_seq", partSeq[p], "recorded_seq", rec, "recorded_in", from,
			"missing", strconv.FormatUint(partSeq[p]+1, 10)+".."+strconv.FormatUint(rec, 10))
		partSeq[p] = rec
	}
}

// recordSeqs records seqs, the partition sequences as of the confirmed
// position lsn, in the data dir and on the source, before lsn is
// confirmed. A record that fails is logged (once until one succeeds
// again) and does not stop the capture: the other record, and the stream,
// still hold. ok is false when the source's record failed: the caller
// records again at its next confirmation.
func (s *Service) recordSeqs(lsn event.LSN, seqs []uint64) (ok bool) {
	ok = true
	if s.cfg.DataDir != "" {
		b, _ := json.Marshal(seqFileBody{Stream: event.StreamName(s.cfg.SourceName), ConfirmedLSN: lsn.String(), Seqs: seqs})
		err := writeFileAtomic(seqFile(s.cfg.DataDir, s.cfg.SourceName), append(b, '\n'))
		s.recordFailed("data dir", &s.seqFileFailing, err)
	}
	if s.seqTableOK.Load() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		vals := make([]int64, len(seqs))
		for i, v := range seqs {
			vals[i] = int64(v)
		}
		_, err := s.pool.Exec(ctx, sqlSeqRecord, event.StreamName(s.cfg.SourceName), vals, lsn.String(), int64(s.timeline.Load()))
		s.recordFailed("source", &s.seqTableFailing, err)
		ok = err == nil
	}
	return ok
}

func (s *Service) recordFailed(where string, failing *bool, err error) {
	switch {
	case err != nil && !*failing:
		*failing = true
		s.m.seqRecordErrors.Inc()
		s.log.Warn("cannot record the partition sequences; retrying at the next confirmation", "in", where, "err", redactErr(err))
	case err != nil:
		s.m.seqRecordErrors.Inc()
	case *failing:
		*failing = false
		s.log.Info("partition sequences recorded again", "in", where)
	}
}

// writeFileAtomic writes a 0600 file by renaming a complete temporary one
// over it. Not synced: it is written at every confirmation, in the
// streaming loop, and a file an OS crash leaves older is no loss (a start
// takes the highest of it, the source's record and the stream).
func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	err = tmp.Chmod(0o600)
	if err == nil {
		_, err = tmp.Write(data)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	return err
}

// resetSeqRecords removes both records of the source's stream, before a
// new stream is made.
func (s *Service) resetSeqRecords(ctx context.Context) error {
	if s.cfg.DataDir != "" {
		if err := os.Remove(seqFile(s.cfg.DataDir, s.cfg.SourceName)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove the partition sequences recorded for an earlier stream: %w", err)
		}
	}
	if s.seqTableOK.Load() {
		if _, err := s.pool.Exec(ctx, `DELETE FROM `+seqTable+` WHERE stream = $1`, event.StreamName(s.cfg.SourceName)); err != nil {
			return fmt.Errorf("remove the partition sequences recorded in %s for an earlier stream: %s", seqTable, redactErr(err))
		}
	}
	return nil
}

// seqsChanged reports whether seqs differ from the last recorded ones.
func seqsChanged(recorded, seqs []uint64) bool { return !slices.Equal(recorded, seqs) }
