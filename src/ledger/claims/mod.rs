//! Claims: what a shard remembers of each `(subscriber, key)` it decided, by generation.
//!
//! - `record.rs`: the stored claim ([`record::ClaimRecord`]: expiry, fingerprint, outcome)
//!   and the format version;
//! - `generation.rs`: the active generation (exact in-memory index + append-only log
//!   table), sealing ones, sealed ones, and the builder thread that sorts and seals them
//!   (a subscriber's whole state on one shard, claims among it, is `shard::SubState`);
//! - `block.rs`: the sorted blocks of a sealed generation and their lookup;
//! - `filter.rs`: the static filter of a sealed generation (and the halves other shards
//!   probe for presence).
//!
//! Sealing, merging and expiring generations run on the shard (`shard/maintain.rs`,
//! `shard/merge.rs`), which owns the transaction they write in.

pub(crate) mod block;
pub mod filter;
pub(crate) mod generation;
pub mod record;
