//! The on-disk layout every other part of the ledger writes through.
//!
//! - `tables.rs`: every redb table of a shard file, its key and value types, and the
//!   table names of per-subscriber tables;
//! - `datadir.rs`: the data directory: the manifest, the shard files it names, private
//!   files and directories, byte counts, and the format check and upgrade on open.

pub(crate) mod datadir;
pub(crate) mod tables;
