package main

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func TestBar(t *testing.T) {
	for _, c := range []struct {
		f    float64
		want string
	}{
		{0, "[----------]   0.0%"},
		{0.25, "[##--------]  25.0%"},
		{1, "[##########] 100.0%"},
		{1.7, "[##########] 100.0%"},
		{-1, "[----------]   0.0%"},
	} {
		require.Equal(t, c.want, bar(c.f, 10), "%g", c.f)
	}
}

// The status table names an unavailable version and shows a partition no
// worker holds as "(none)", its lag and its pending age.
func TestStatusTable(t *testing.T) {
	st := &status.Status{Source: "main", Stream: "EPITAPH_MAIN", StreamLast: 30, Partitions: 2,
		Versions: []status.VersionStatus{{Projection: "archive", Version: 1, State: "live", Health: "unavailable",
			Schema: "archive_v1", LagEvents: 12, OldestPendingAgeSeconds: 10,
			Partitions: []status.PartitionStatus{
				{Partition: 0, Owner: "w1", Epoch: 3, Cursor: 18, LagEvents: 12, OldestPendingAgeSeconds: 10},
				{Partition: 1, Owner: "w2", Leased: true, Epoch: 1, Cursor: 12},
			}}}}
	var buf bytes.Buffer
	require.NoError(t, writeStatusTable(&buf, st))
	out := buf.String()
	require.Contains(t, out, "source main  stream EPITAPH_MAIN  last seq 30  partitions 2")
	require.Regexp(t, `(?m)^archive\s+1\s+live\s+unavailable\s+archive_v1\s+12\s+10s\s+0\s+0\s+false\s+-\s*$`, out)
	require.Regexp(t, `(?m)^0\s+\(none\)\s+3\s+18\s+-\s+12\s+10s\s+-\s+-\s*$`, out)
	require.Regexp(t, `(?m)^1\s+w2\s+1\s+12\s+-\s+0\s+-\s+-\s+-\s*$`, out)
}

// A lag that was not measured is "unknown" (a stream error) or "-" (a
// retired version) in the table, and null in JSON; a measured 0 stays 0.
func TestStatusUnmeasuredLag(t *testing.T) {
	const why = "NATS nats://127.0.0.1:1 unreachable: nats: no servers available for connection"
	st := &status.Status{Source: "main", Stream: "EPITAPH_MAIN", StreamError: why,
		Versions: []status.VersionStatus{
			{Projection: "archive", Version: 2, State: "live", Health: "live", Schema: "archive_v2", LagUnknown: why,
				Partitions: []status.PartitionStatus{{Partition: 0, Owner: "w1", Leased: true, Epoch: 1, Cursor: 5, LagUnknown: why}}},
			{Projection: "archive", Version: 1, State: "retired", Health: "retired", Schema: "archive_v1"},
			{Projection: "archive", Version: 3, State: "building", Health: "building", Schema: "archive_v3",
				Partitions: []status.PartitionStatus{{Partition: 0, Cursor: 9}}},
		}}
	var buf bytes.Buffer
	require.NoError(t, writeStatusTable(&buf, st))
	out := buf.String()
	require.Regexp(t, `(?m)^archive\s+2\s+live\s+live\s+archive_v2\s+unknown\s+unknown\s`, out)
	require.Regexp(t, `(?m)^archive\s+1\s+retired\s+retired\s+archive_v1\s+-\s+-\s`, out)
	require.Regexp(t, `(?m)^archive\s+3\s+building\s+building\s+archive_v3\s+0\s+-\s`, out)
	require.Regexp(t, `(?m)^0\s+w1\s+1\s+5\s+-\s+unknown\s+unknown\s`, out)
	require.Contains(t, out, "archive v2 lag unknown: "+why)

	raw, err := json.Marshal(st)
	require.NoError(t, err)
	var doc struct {
		Versions []struct {
			LagEvents  *uint64  `json:"lag_events"`
			Oldest     *float64 `json:"oldest_pending_age_seconds"`
			LagUnknown string   `json:"lag_unknown"`
			Partitions []struct {
				LagEvents  *uint64  `json:"lag_events"`
				LagSeconds *float64 `json:"lag_seconds"`
			} `json:"partitions"`
		} `json:"versions"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc))
	require.Nil(t, doc.Versions[0].LagEvents, string(raw))
	require.Nil(t, doc.Versions[0].Oldest)
	require.Equal(t, why, doc.Versions[0].LagUnknown)
	require.Nil(t, doc.Versions[0].Partitions[0].LagEvents)
	require.Nil(t, doc.Versions[0].Partitions[0].LagSeconds)
	require.Nil(t, doc.Versions[1].LagEvents, "a retired version is not measured")
	require.NotNil(t, doc.Versions[2].LagEvents, "a measured 0")
	require.Zero(t, *doc.Versions[2].LagEvents)
	require.NotNil(t, doc.Versions[2].Partitions[0].LagEvents)
}

// A differing snapshot document is listed with the count, and the verdict
// says what differs and how to accept it.
func TestComparisonText(t *testing.T) {
	c := &version.Comparison{Projection: "archive", A: 1, B: 2, UpTo: "0/16B3748", ContentEqual: true,
		Tables:             []version.TableComparison{{Schema: "public", Table: "orders", RowsA: 4, RowsB: 4, ChecksumA: "7", ChecksumB: "7"}},
		DocumentsDiffer:    1,
		DifferingDocuments: []snapshot.DocumentDifference{{RootTable: "public.orders", RootKey: json.RawMessage(`{"id":3}`), What: "payload"}}}
	var buf bytes.Buffer
	require.NoError(t, writeComparison(&buf, c))
	out := buf.String()
	require.Contains(t, out, "archive v1 vs v2: transactions committed at or before 0/16B3748 (both versions reflect them)")
	require.Regexp(t, `(?m)^public\.orders\s+4\s+4\s+7\s+7\s+0\s+0\s+0\s+0\s*$`, out)
	require.Contains(t, out, "DIFFERING DOCUMENT (1)")
	require.Regexp(t, `(?m)^public\.orders\s+\{"id":3\}\s+payload\s*$`, out)
	require.Contains(t, out, "EQUAL content, but DIFFERENT; snapshot jobs or documents differ (pass --ignore snapshots")
}

// A gap row shows what is unknown as "?" and an informational truncate.
func TestGapsText(t *testing.T) {
	schema, table, from := "public", "orders", int64(5)
	detected := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	vgs := []status.VersionGaps{{Projection: "archive", Version: 2, State: "building", Gaps: []archive.Gap{
		{ID: 7, Kind: "truncate", Schema: &schema, Table: &table, FromSeq: &from, DetectedAt: detected},
	}}, {Projection: "archive", Version: 3, State: "building"}}
	var buf bytes.Buffer
	require.NoError(t, writeGaps(&buf, vgs))
	out := buf.String()
	require.Contains(t, out, "archive v2 (building): 1 gaps")
	require.Regexp(t, `(?m)^7\s+truncate\s+public\.orders\s+\(all\)\s+\?\s+\?\s+5-\?\s+2026-12-01T10:00:00Z\s+\(informational\)\s*$`, out)
	require.Contains(t, out, "archive v3 (building): 0 gaps")
}
