//! The changelog of a Kafka subscription (`changelog = true`): claims and handler state
//! that follow their input partitions between the instances of one consumer group.
//!
//! - **Publish.** Before a shard commits a batch, every message it processed is produced
//!   (idempotent producer, `acks=all`) to partition p of `<prefix>-<subscriber>-changelog`,
//!   p being the message's input partition, and the shard waits for the acknowledgements
//!   (`ledger/changelog.rs`). A member's ledger is therefore never ahead of the changelog,
//!   and an offset (stored after the local commit, G1) never passes a message whose claim
//!   and state are not in the changelog.
//! - **Record.** Key: the claim key and the time it was processed (24 bytes, big-endian;
//!   `record_key`). Value: a format byte, then the [`Change`](crate::ledger::changelog::Change) (claim, entity, state
//!   written, marks, versions) in bincode's standard encoding. One record per processed
//!   message, so a record is all of one message's effects or none of them. No two
//!   processings share a key, so the log cleaner drops a record only once it has a
//!   tombstone: `compaction.rs` sends one for every expired claim, after publishing the
//!   handler state it wrote as **snapshots** — one record per item, keyed by the item
//!   (`snapshot_key`), holding its current value as a change with no claim.
//! - **Emitted.** Every message a handler emitted (an outbox row) is a record of its own in
//!   the same partition, keyed `O` + the hash of its deterministic id (`emitted_key`),
//!   holding the message and its claim's expiry. The outbox relay tombstones it once the
//!   broker acknowledged the message. A restore puts every emitted message with no
//!   tombstone back into the new owner's outbox (unless it is pending there already), so a
//!   member that dies with rows not yet relayed — and its data directory with it — loses
//!   none: the new owner relays them, under the same `dedupd-message-id` (a row relayed
//!   just before the crash, before its tombstone, is relayed twice with one id).
//! - **Records.** Every quarantine and dead-letter record of a message from partition p is a
//!   record of its own there, keyed `R` + its kind + the key hash and payload fingerprint it
//!   is merged by (`record_copy_key`), holding its current body (a repeat publishes the
//!   bumped `count` again); a record removed by its owner (discarded, settled by a replay,
//!   swept by the retention, evicted by the cap) gets a tombstone. A restore puts every
//!   record without one into the new owner's tables, so a member that dies with its disk
//!   loses none of the messages it set aside.
//! - **Restore.** When partitions are assigned, before any of their messages is fetched
//!   (the rebalance callback), their changelog partitions are read from the beginning to
//!   the end offset found at the start, and every change is replayed into the ledger
//!   ([`crate::ledger::Job::restore`]) on the shard the message itself would use. Changes
//!   replay in offset order and carry absolute values, so replaying a changelog over a
//!   ledger that already holds a prefix of it (this member owned the partition before)
//!   ends in exactly the changelog's claims and state.
//! - **Fences.** A member that is assigned partition p first produces a fence record there
//!   (`fence_key`) and waits for its offset, its **epoch** for p; only then does it
//!   restore (to an end offset read after the fence) and process. Every value it publishes
//!   for p afterwards starts with that epoch (`EPOCH_FORMAT`). A restore skips a value
//!   whose epoch is older than the newest fence before it: it came from a member that lost
//!   p and kept publishing (a "zombie", paused past its session timeout), after the new
//!   owner had taken p over. Every restore — the new owner's and any later one — so ends
//!   in the same claims and state: the zombie's changes before the new fence in all of
//!   them, those after it in none. Fence keys are unique, so compaction keeps every fence.
//!
//! This file holds the description above; the code lives by concern:
//! - `record.rs`: the record format — keys of every kind (changes, snapshots, emitted
//!   messages, quarantine and dead-letter records, fences), epochs, value encoding;
//! - `producer.rs`: [`ChangelogProducer`], publishing a batch's records under this
//!   member's epochs, fences and tombstones, and the acknowledgements a shard waits for;
//! - `error.rs`: `ChangelogError`, why a publish failed or a record could not be read
//!   (a record's own faults are `RecordError`s, in `record.rs`);
//! - `topics.rs`: the changelog topic's name, partition count and creation;
//! - `restore.rs`: reading the changelog back into the ledger ([`restore()`]) and the
//!   checkpoints that let the next restore start where this one ended.

mod error;
mod producer;
mod record;
mod restore;
mod topics;

pub(crate) use error::ChangelogError;
pub(crate) use producer::Acked;
pub use producer::ChangelogProducer;
pub use record::is_fence_key;
pub(crate) use record::{decode, decode_emitted, emitted_key, is_emitted_key};
pub(crate) use record::{is_record_key, is_snapshot_key, split_epoch, RecordError, EPOCH_FORMAT};
pub use restore::restore;
pub(crate) use restore::{checkpoint, checkpoint_key};
pub(crate) use topics::{create_topic, partition_count, topic_name};
