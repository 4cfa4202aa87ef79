// Package retention deletes archive rows past their expires_at, in
// bounded batches, from every version of the archive.
//
// # Contract
//
// A row past expires_at is hidden from archive.rows at once (the reader
// view filters it; package projection/archive) and deleted here later. A
// row is kept (hidden, present) while a delivery of it is pending or in
// flight (epitaph.deliveries), while it is after the cursor of a cursor
// handler of its table (epitaph.handler_cursors: such a handler's pending
// deliveries have no row until they settle) or while a legal hold covers
// it (epitaph.legal_holds); its terminal deliveries are deleted with it once
// no version holds it. Snapshot documents go with their root row; a
// snapshot group goes with the last row of its transaction.
//
// CleanupBatch runs one batch over every version (VersionSchemas: retired
// ones included, since every version's rows expire), deleting at most
// CleanupOptions.Batch rows over all versions, oldest expiry first. Each
// version is cleaned in its own transaction under a per-version advisory
// lock, so two cleaners never clean one version at once (the second skips
// it and says so in CleanupResult.Skipped).
//
// Cleaner runs batches in the background (internal/startstop): a soft
// Stop lets the batch in flight finish, the hard stop rolls it back. It
// adapts its batch size between MinCleanupBatch and MaxCleanupBatch so a
// batch takes about a quarter of its StatementTimeout, and while the
// projector is applying pages (CleanerConfig.Busy) it paces itself to
// CleanerConfig.Rate rows a second (DefaultCleanupRate) unless it has
// fallen more than an hour behind. Metrics are its
// Prometheus metrics (rows expired, the oldest due row, errors, the batch
// size) and the fences' count of rows not archived.
//
// Imports point one way: this package builds on projection/archive; the
// runtime (package projection) starts a Cleaner and the programs call
// CleanupBatch (`projector cleanup`); it imports neither.
package retention
