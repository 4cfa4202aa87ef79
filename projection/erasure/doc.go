// Package erasure removes data from the archive for good and keeps it
// from coming back: erasures (Erase, PurgeStream), the fences every apply
// checks, and legal holds.
//
// # Contract
//
// Erase removes the rows of one table that match a key or a selector
// (EraseOptions: Key, or Match by JSON containment), with their children
// in the same source transaction when WithChildren, from every version of
// the archive, their snapshot documents (rebuilt without them), their
// deliveries, and the matching quarantine entries; it records a Receipt
// (epitaph.erasures) that says what was removed where and how many, never
// the data; an erased row's pending delivery to a cursor handler (it has
// no row until its batch settles) is recorded stopped, keyless. It waits
// for applies in flight (the erasure lock, bounded by
// LockTimeout), so an apply that started before sees the rows gone and
// one that starts after sees the fence. A legal hold covering a matched
// row makes Erase fail with ErrHeld and change nothing, unless
// IgnoreHolds. PurgeStream then deletes the matching messages (and large
// row objects) from the source's stream; CheckPurge tells first, before
// anything is erased, whether the stream and the credentials allow it.
//
// Fences. A fence holds no erased value: the table, the sorted names of
// the matched columns and an HMAC-SHA256 of their canonical values
// (epitaph.erasure_secret). Every version's apply, rebuilds and replays
// included, passes its rows through a FenceSet (FilterRows, on the
// caller's own row type through the Row interface) before inserting them,
// so erased data never returns; children erased with their parent are
// fenced by identity, and a parent met in one page fences its children in
// the later pages of its transaction (Record). The insert reads the
// erasure counter under the erasure lock; an apply whose fences are older
// than that counter gets ErrFencesChanged and applies the page again.
//
// Legal holds (AddLegalHold, ListLegalHolds, RemoveLegalHold) keep the
// rows they cover past their expiry (package projection/retention honours
// them) and refuse their erasure. They are unrelated to the runtime's hold
// mode, which keeps later events of a quarantined row back.
//
// Imports point one way: this package builds on projection/archive and
// projection/snapshot; the runtime (package projection) calls the fence
// check in its apply, and the programs call Erase (`projector erase`);
// it imports neither.
package erasure
