// Package status answers, for readers and operators, whether a projection
// can be trusted and how far it is complete: readiness, waits, gaps and
// the status document. It only reads; it never takes a lock a worker
// holds, so asking never slows the projector down.
//
// # Contract
//
// ReadReadiness is archive.status (archive.StatusQuery) for any projection:
// per version whether it is ready (live, every partition leased, started
// and not failing, lag sampled by the workers fresh and within their
// thresholds, no open quarantine, no unacknowledged blocking gap), why
// not, and how far into the source it is complete. An empty archive is
// never to be read as "nothing was deleted" without it. ViewState folds
// readiness into the one word the read API and the status page show.
//
// Waits. Reflects and WaitLSN compare the live version's watermarks (the
// lowest source_lsn over its partitions) with a source LSN. WaitComplete
// returns once the live version is complete up to an LSN, and fails at
// once with an IncompleteError naming the gaps and quarantined events
// (Blockers) that keep it from ever being; a TimeoutError says how far it
// got. WaitHandler serves it as GET /wait, bounded by MaxWaitTimeout.
//
// Gaps. ListGaps lists the rows of every version's gaps table; AckGap
// acknowledges one with a reason (required, recorded once): an
// acknowledged lost_upstream or removed_from_stream gap no longer keeps
// the version from being ready or complete.
//
// Status. CollectStatus reads the status of every version of a source's
// projections from the target database and, when given, the stream: per
// partition its lease, cursor, watermark and lag (PartitionLag, also what
// the runtime's workers sample), per version its lifecycle
// (VersionLifecycle: boundary, transitions, rebuild progress) and
// readiness, and the workers seen. Without a stream the lags are unknown
// (LagUnknown, null in JSON), never zero, and StreamError says why.
//
// Imports point one way: this package builds on projection/archive and
// projection/version; the runtime (package projection) and the programs
// import it, never the other way round. Readers (packages readapi and
// statuspage) import this package, not the runtime.
package status
