//! What sits under a shard file, and the bench's naive store: the ledger's code that is
//! not the claim logic, kept apart from it.
//!
//! - `tracked.rs`: the redb storage backend under every shard file (the product's): it
//!   records the byte ranges a writer writes while an online backup copies the file, and
//!   the [`Rendezvous`](tracked::Rendezvous) where every writer meets for the copy's last
//!   step; used by `shard/open.rs`, `shard/control.rs` and `ops/backup.rs`;
//! - `fault.rs`: fault injection for the crash-consistency tests (failing disk, power cut,
//!   torn write, full disk, failing reads), a storage backend under `tracked.rs` when a
//!   test arms the ledger's [`FaultSwitch`](super::FaultSwitch) (`tests/storage_failure.rs`,
//!   `tests/backup.rs`); compiled into the product because integration tests are another
//!   crate that links it (a ledger never armed never uses it), so it cannot be
//!   `#[cfg(test)]`;
//! - `naive.rs`: the baseline `dedupd bench` measures the engine against
//!   ([`NaiveBaseline`](super::NaiveBaseline)): one redb table, get-then-insert, a commit per
//!   batch. It is here because redb is used only inside the ledger.

pub(super) mod fault;
pub(super) mod naive;
pub(super) mod tracked;
