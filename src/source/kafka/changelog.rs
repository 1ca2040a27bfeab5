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
//!   [`record_key`]). Value: a format byte, then the [`Change`] (claim, entity, state
//!   written, marks, versions) in bincode's standard encoding. One record per processed
//!   message, so a record is all of one message's effects or none of them. No two
//!   processings share a key, so the log cleaner drops a record only once it has a
//!   tombstone: `compaction.rs` sends one for every expired claim, after publishing the
//!   handler state it wrote as **snapshots** — one record per item, keyed by the item
//!   ([`snapshot_key`]), holding its current value as a change with no claim.
//! - **Emitted.** Every message a handler emitted (an outbox row) is a record of its own in
//!   the same partition, keyed `O` + the hash of its deterministic id ([`emitted_key`]),
//!   holding the message and its claim's expiry. The outbox relay tombstones it once the
//!   broker acknowledged the message. A restore puts every emitted message with no
//!   tombstone back into the new owner's outbox (unless it is pending there already), so a
//!   member that dies with rows not yet relayed — and its data directory with it — loses
//!   none: the new owner relays them, under the same `dedupd-message-id` (a row relayed
//!   just before the crash, before its tombstone, is relayed twice with one id).
//! - **Records.** Every quarantine and dead-letter record of a message from partition p is a
//!   record of its own there, keyed `R` + its kind + the key hash and payload fingerprint it
//!   is merged by ([`record_copy_key`]), holding its current body (a repeat publishes the
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
//!   ([`fence_key`]) and waits for its offset, its **epoch** for p; only then does it
//!   restore (to an end offset read after the fence) and process. Every value it publishes
//!   for p afterwards starts with that epoch ([`EPOCH_FORMAT`]). A restore skips a value
//!   whose epoch is older than the newest fence before it: it came from a member that lost
//!   p and kept publishing (a "zombie", paused past its session timeout), after the new
//!   owner had taken p over. Every restore — the new owner's and any later one — so ends
//!   in the same claims and state: the zombie's changes before the new fence in all of
//!   them, those after it in none. Fence keys are unique, so compaction keeps every fence.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;

use super::{KafkaConfig, KafkaError};
use crate::ledger::changelog::{Change, ChangelogSink, Published, RecordCopy, SnapshotItem};
use crate::ledger::{Done, Job, Ledger, Origin, Outcome, RecordKind, Subscriber};

/// The first byte of every record value: the encoding of what follows.
const FORMAT: u8 = 1;
/// Restore jobs per submission to one shard.
const CHUNK: usize = 1024;
/// Restore jobs waiting for their outcome before reading more of the changelog.
const MAX_IN_FLIGHT: usize = 32 * 1024;

/// The changelog topic of a subscriber.
pub fn topic_name(prefix: &str, subscriber: &str) -> String {
    format!("{prefix}-{subscriber}-changelog")
}

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// A change's record key: the claim key and when it was processed (both big-endian). A
/// message processed again after its claim expired is a new record, so compaction never
/// drops the state an earlier processing wrote.
pub fn record_key(change: &Change) -> [u8; 24] {
    let mut k = [0u8; 24];
    k[..16].copy_from_slice(&change.key.to_be_bytes());
    k[16..].copy_from_slice(&change.processed_at_ms.to_be_bytes());
    k
}

/// The first byte of a snapshot record's key (a change's key is 24 bytes of hash and time).
const SNAPSHOT_KEY: u8 = b'S';

/// A snapshot record's key: `S` and the xxh3-128 of the item's identity (big-endian), the
/// same for every snapshot of the item, so the log cleaner keeps only the newest.
pub fn snapshot_key(item: &SnapshotItem<'_>) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = SNAPSHOT_KEY;
    k[1..].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&item.identity()).to_be_bytes());
    k
}

/// Whether a record key is a snapshot's.
pub fn is_snapshot_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == SNAPSHOT_KEY
}

/// The first byte of a fence record's key.
const FENCE_KEY: u8 = b'F';
/// A fence record's value: this byte alone.
const FENCE_FORMAT: u8 = 5;

/// A fence record's key: `F` and 16 bytes no other fence has (the producing member's
/// nonce), so the log cleaner keeps every fence: a restore needs the newest fence before
/// each record, not only the newest of the partition.
pub fn fence_key(nonce: u128) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = FENCE_KEY;
    k[1..].copy_from_slice(&nonce.to_be_bytes());
    k
}

/// Whether a record key is a fence's.
pub fn is_fence_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == FENCE_KEY
}

/// The first byte of a value published under an epoch: then the epoch (8 bytes,
/// big-endian: the offset of the publishing member's fence in this partition), then the
/// value itself, with its own format byte.
pub const EPOCH_FORMAT: u8 = 4;

/// A record value's epoch (`None`: published with no fence, by an earlier version) and
/// the value under it.
pub fn split_epoch(value: &[u8]) -> Result<(Option<u64>, &[u8]), String> {
    match value.split_first() {
        Some((&EPOCH_FORMAT, rest)) => {
            let (epoch, inner) = rest
                .split_first_chunk::<8>()
                .ok_or_else(|| format!("an epoch of {} bytes, not 8", rest.len()))?;
            Ok((Some(u64::from_be_bytes(*epoch)), inner))
        }
        _ => Ok((None, value)),
    }
}

/// The first byte of an emitted record's key.
const EMITTED_KEY: u8 = b'O';
/// The first byte of an emitted record's value (a change's is [`FORMAT`]).
const EMITTED_FORMAT: u8 = 2;

/// An emitted record's key: `O` and the xxh3-128 of the message's id (deterministic, the
/// same for every processing that emits it), so the relay's tombstone names it.
pub fn emitted_key(message_id: &str) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = EMITTED_KEY;
    k[1..].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(message_id.as_bytes()).to_be_bytes());
    k
}

/// Whether a record key is an emitted record's.
pub fn is_emitted_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == EMITTED_KEY
}

/// A message a handler emitted, as its changelog record carries it until the relay
/// tombstones it: with the expiry of the claim of the message that emitted it, so
/// compaction tombstones one that nothing relayed (an outbox read over HTTP) with that
/// claim's record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Emitted {
    pub expires_at_ms: u64,
    pub message: crate::effects::OutboxMessage,
}

/// An emitted message as a record value.
pub fn encode_emitted(emitted: &Emitted) -> Result<Vec<u8>, String> {
    encode_value(EMITTED_FORMAT, EMITTED, emitted)
}

/// [`Emitted`] over a borrowed message, encoded the same (fields in the same order):
/// publishing encodes the change's own messages instead of copying each one first.
#[derive(serde::Serialize)]
struct EmittedRef<'a> {
    expires_at_ms: u64,
    message: &'a crate::effects::OutboxMessage,
}

/// An emitted record's value; an error names what is wrong with it.
pub fn decode_emitted(value: &[u8]) -> Result<Emitted, String> {
    decode_value(value, EMITTED_FORMAT, EMITTED)
}

/// The first byte of a quarantine or dead-letter record's key.
const RECORD_KEY: u8 = b'R';
/// The first byte of such a record's value.
const RECORD_FORMAT: u8 = 3;
const RECORD_KEY_LEN: usize = 2 + 16 + 8;

/// A quarantine or dead-letter record's key: `R`, `q` or `d`, then the key hash and the
/// payload fingerprint its repeats are merged by (big-endian), so a repeat's record
/// replaces it and the owner's tombstone names it.
pub fn record_copy_key(copy: &RecordCopy) -> [u8; RECORD_KEY_LEN] {
    let mut k = [0u8; RECORD_KEY_LEN];
    k[0] = RECORD_KEY;
    k[1] = match copy.kind {
        RecordKind::Quarantine => b'q',
        RecordKind::DeadLetter => b'd',
    };
    k[2..18].copy_from_slice(&copy.key.to_be_bytes());
    k[18..].copy_from_slice(&copy.fingerprint.to_be_bytes());
    k
}

/// Whether a record key is a quarantine or dead-letter record's.
pub fn is_record_key(key: &[u8]) -> bool {
    key.len() == RECORD_KEY_LEN && key[0] == RECORD_KEY
}

/// The removal a tombstone with `key` stands for (a copy with no body), if the key is a
/// quarantine or dead-letter record's.
pub fn removed_record(key: &[u8], partition: i32) -> Option<RecordCopy> {
    if !is_record_key(key) {
        return None;
    }
    let kind = match key[1] {
        b'q' => RecordKind::Quarantine,
        b'd' => RecordKind::DeadLetter,
        _ => return None,
    };
    Some(RecordCopy {
        kind,
        key: u128::from_be_bytes(key[2..18].try_into().ok()?),
        fingerprint: u64::from_be_bytes(key[18..].try_into().ok()?),
        route: 0,
        body: None,
        partition,
    })
}

/// A stored quarantine or dead-letter record as a record value.
pub fn encode_record(copy: &RecordCopy) -> Result<Vec<u8>, String> {
    encode_value(RECORD_FORMAT, RECORD, copy)
}

/// A quarantine or dead-letter record's value; an error names what is wrong with it.
pub fn decode_record(value: &[u8]) -> Result<RecordCopy, String> {
    decode_value(value, RECORD_FORMAT, RECORD)
}

/// A change as a record value.
pub fn encode(change: &Change) -> Result<Vec<u8>, String> {
    encode_value(FORMAT, CHANGE, change)
}

/// A record value as a change; an error names what is wrong with it.
pub fn decode(value: &[u8]) -> Result<Change, String> {
    decode_value(value, FORMAT, CHANGE)
}

/// What a record value holds, as errors name it: (article, noun, format name).
type Kind = (&'static str, &'static str, &'static str);
const CHANGE: Kind = ("a", "change", "change");
const EMITTED: Kind = ("an", "emitted message", "emitted-message");
const RECORD: Kind = ("a", "quarantine or dead-letter record", "record");

/// A record value: the format byte, then `v` in bincode's standard encoding.
fn encode_value<T: serde::Serialize>(format: u8, kind: Kind, v: &T) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    encode_value_into(&mut out, format, kind, v)?;
    Ok(out)
}

/// [`encode_value`] appended to `out`.
fn encode_value_into<T: serde::Serialize>(
    out: &mut Vec<u8>,
    format: u8,
    kind: Kind,
    v: &T,
) -> Result<(), String> {
    out.push(format);
    bincode::serde::encode_into_std_write(v, out, bincode_config())
        .map(|_| ())
        .map_err(|e| format!("cannot encode {} {}: {e}", kind.0, kind.1))
}

/// The value [`encode_value`] made with `format`; an error names what is wrong with it
/// (another format, damage, trailing bytes).
fn decode_value<T: serde::de::DeserializeOwned>(
    value: &[u8],
    format: u8,
    kind: Kind,
) -> Result<T, String> {
    match value.split_first() {
        Some((&f, body)) if f == format => {
            let (v, used): (T, usize) = bincode::serde::decode_from_slice(body, bincode_config())
                .map_err(|e| format!("undecodable {}: {e}", kind.1))?;
            if used != body.len() {
                return Err(format!("{} bytes after the {}", body.len() - used, kind.1));
            }
            Ok(v)
        }
        Some((other, _)) => Err(format!(
            "{} format {other} (this build reads format {format}): upgrade dedupd",
            kind.2
        )),
        None => Err("an empty record".into()),
    }
}

/// Acknowledgements still awaited by one `publish` call, and its first error.
#[derive(Default)]
struct Pending {
    state: Mutex<(usize, Option<String>)>,
    done: Condvar,
    /// (partition, offset) of every acknowledged record, when asked for (fences).
    offsets: Option<Mutex<Vec<(i32, i64)>>>,
}

impl Pending {
    fn settle(&self, n: usize, error: Option<String>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.0 = s.0.saturating_sub(n);
        if let Some(e) = error {
            s.1.get_or_insert(e);
        }
        if s.0 == 0 {
            self.done.notify_all();
        }
    }
}

/// The highest offset acknowledged per changelog partition, as delivery reports said.
pub type Acked = Arc<Mutex<std::collections::HashMap<i32, i64>>>;

struct PublishContext {
    acked: Acked,
}

impl ClientContext for PublishContext {}

impl ProducerContext for PublishContext {
    type DeliveryOpaque = Arc<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Arc<Pending>) {
        if let Ok(m) = result {
            let mut acked = self.acked.lock().unwrap_or_else(|p| p.into_inner());
            let top = acked.entry(m.partition()).or_insert(-1);
            *top = (*top).max(m.offset());
            drop(acked);
            if let Some(offsets) = &pending.offsets {
                offsets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((m.partition(), m.offset()));
            }
        }
        pending.settle(1, result.as_ref().err().map(|(e, _)| e.to_string()));
    }
}

/// Publishes a subscriber's changes to its changelog topic ([`ChangelogSink`]).
pub struct ChangelogProducer {
    producer: ThreadedProducer<PublishContext>,
    topic: String,
    /// How long a batch waits for its acknowledgements before the shard stops.
    timeout: Duration,
    /// This member's epoch per partition: the offset of its newest fence there.
    epochs: Mutex<std::collections::HashMap<i32, u64>>,
    /// Makes this producer's fence keys unlike any other member's.
    nonce: u128,
    /// Fences produced so far (each key is the nonce plus this count).
    fences: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ChangelogProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangelogProducer")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl ChangelogProducer {
    /// The highest acknowledged offset per partition (for checkpoints).
    pub fn acked(&self) -> Acked {
        self.producer.context().acked.clone()
    }

    pub fn new(kafka: &KafkaConfig, topic: String) -> Result<ChangelogProducer, KafkaError> {
        let timeout = kafka.changelog.publish_timeout;
        let mut config = super::producer_config(kafka);
        // A shard waits for these acknowledgements: send at once rather than linger.
        config
            .set("linger.ms", "0")
            .set("message.timeout.ms", timeout.as_millis().max(1).to_string());
        let producer = config
            .create_with_context(PublishContext {
                acked: Acked::default(),
            })
            .map_err(|e| KafkaError::Client(format!("changelog producer: {e}")))?;
        // Fence keys of two members must differ: the OS-seeded hasher keys of std, the
        // process and the time.
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        };
        let nonce = xxhash_rust::xxh3::xxh3_128(
            format!("{topic}/{random}/{:?}", std::time::SystemTime::now()).as_bytes(),
        );
        Ok(ChangelogProducer {
            producer,
            topic,
            timeout,
            epochs: Mutex::new(Default::default()),
            nonce,
            fences: Default::default(),
        })
    }

    /// Fences `partitions`: produces a fence record to each and waits for their offsets,
    /// which become this member's epochs there. Call it when the partitions are assigned,
    /// before restoring them: a restore reads to an end offset found after the fence, and
    /// from then on every restore skips what a former owner publishes under its older
    /// epoch. Returns the epochs.
    pub fn fence(&self, partitions: &[i32]) -> Result<Vec<(i32, u64)>, String> {
        let pending = Arc::new(Pending {
            offsets: Some(Mutex::new(Vec::with_capacity(partitions.len()))),
            ..Pending::default()
        });
        pending.state.lock().unwrap_or_else(|p| p.into_inner()).0 = partitions.len();
        for (i, &p) in partitions.iter().enumerate() {
            // Never reused: the count makes each key unique within this member.
            let n = self
                .fences
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let key = fence_key(self.nonce.wrapping_add(u128::from(n)));
            if let Err(e) = self.send(&pending, p, &key, Some(&[FENCE_FORMAT])) {
                pending.settle(partitions.len() - i, None);
                return Err(e);
            }
        }
        self.acks(pending.clone(), partitions.len()).wait()?;
        let offsets = pending
            .offsets
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default();
        let mut fenced = Vec::with_capacity(partitions.len());
        let mut epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        for &p in partitions {
            let Some(&(_, offset)) = offsets.iter().find(|(q, _)| *q == p) else {
                return Err(format!(
                    "no offset reported for the fence of {}/{p}",
                    self.topic
                ));
            };
            let epoch = offset.max(0) as u64;
            epochs.insert(p, epoch);
            fenced.push((p, epoch));
        }
        Ok(fenced)
    }

    /// This member's epoch in `partition`, if it fenced it.
    pub fn epoch(&self, partition: i32) -> Option<u64> {
        self.epochs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&partition)
            .copied()
    }
}

impl ChangelogProducer {
    /// Produces one record (a tombstone when `value` is `None`), waiting while the
    /// producer's queue is full, up to the publish timeout.
    fn send(
        &self,
        pending: &Arc<Pending>,
        partition: i32,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), String> {
        let mut record = BaseRecord::with_opaque_to(&self.topic, pending.clone())
            .partition(partition)
            .key(key);
        if let Some(v) = value {
            record = record.payload(v);
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((RdError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    record = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => return Err(format!("producing to {}: {e}", self.topic)),
            }
        }
    }

    /// The acknowledgements of `count` records sent with `pending`.
    fn acks(&self, pending: Arc<Pending>, count: usize) -> Box<dyn Published> {
        Box::new(Acks {
            pending,
            count,
            topic: self.topic.clone(),
            // Deliveries fail on their own once `message.timeout.ms` passes; the margin
            // covers the report's way back.
            deadline: Instant::now() + self.timeout + Duration::from_secs(5),
            timeout: self.timeout,
        })
    }

    /// Produces a tombstone (a record with no value) for each record key to `partition`,
    /// so the broker's log cleaner drops every record with that key.
    pub fn tombstone(
        &self,
        partition: i32,
        keys: &[Vec<u8>],
    ) -> Result<Box<dyn Published>, String> {
        let pending = Arc::new(Pending::default());
        pending.state.lock().unwrap_or_else(|p| p.into_inner()).0 = keys.len();
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = self.send(&pending, partition, key, None) {
                pending.settle(keys.len() - i, None);
                return Err(e);
            }
        }
        Ok(self.acks(pending, keys.len()))
    }
}

impl ChangelogSink for ChangelogProducer {
    fn publish(&self, changes: &[Change]) -> Result<Box<dyn Published>, String> {
        // Every key and value is written into one buffer (a record is its partition and
        // two ranges of it): librdkafka copies them as they are sent, so nothing is
        // allocated per record.
        let mut buf: Vec<u8> = Vec::with_capacity(changes.len() * 96);
        let mut records: Vec<(i32, Range<usize>, Option<Range<usize>>)> =
            Vec::with_capacity(changes.len());
        let key = |buf: &mut Vec<u8>, k: &[u8]| {
            let start = buf.len();
            buf.extend_from_slice(k);
            start..buf.len()
        };
        // A value starts with this member's epoch in its partition (see the module docs).
        let epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        let begin = |buf: &mut Vec<u8>, epoch: Option<u64>| {
            let start = buf.len();
            if let Some(e) = epoch {
                buf.push(EPOCH_FORMAT);
                buf.extend_from_slice(&e.to_be_bytes());
            }
            start
        };
        for change in changes {
            let Some(partition) = change.origin.as_ref().and_then(Origin::kafka_partition) else {
                return Err(format!(
                    "message {:?} did not come from Kafka: a changelog takes only Kafka messages",
                    change.id
                ));
            };
            let epoch = epochs.get(&partition).copied();
            if let Some(copy) = &change.record {
                let k = key(&mut buf, &record_copy_key(copy));
                let value = match copy.body {
                    Some(_) => {
                        let start = begin(&mut buf, epoch);
                        encode_value_into(&mut buf, RECORD_FORMAT, RECORD, copy)?;
                        Some(start..buf.len())
                    }
                    None => None,
                };
                records.push((partition, k, value));
            } else if change.snapshot {
                for (item, value) in change.snapshot_items() {
                    let k = key(&mut buf, &snapshot_key(&item));
                    let value = match value {
                        Some(v) => {
                            let start = begin(&mut buf, epoch);
                            encode_value_into(&mut buf, FORMAT, CHANGE, &v)?;
                            Some(start..buf.len())
                        }
                        None => None,
                    };
                    records.push((partition, k, value));
                }
            } else {
                let k = key(&mut buf, &record_key(change));
                let start = begin(&mut buf, epoch);
                encode_value_into(&mut buf, FORMAT, CHANGE, change)?;
                records.push((partition, k, Some(start..buf.len())));
                for m in &change.emitted {
                    let k = key(&mut buf, &emitted_key(&m.id));
                    let start = begin(&mut buf, epoch);
                    let emitted = EmittedRef {
                        expires_at_ms: change.expires_at_ms,
                        message: m,
                    };
                    encode_value_into(&mut buf, EMITTED_FORMAT, EMITTED, &emitted)?;
                    records.push((partition, k, Some(start..buf.len())));
                }
            }
        }
        drop(epochs);
        let pending = Arc::new(Pending::default());
        pending.state.lock().unwrap_or_else(|p| p.into_inner()).0 = records.len();
        for (i, (partition, key, value)) in records.iter().enumerate() {
            let value = value.as_ref().map(|v| &buf[v.clone()]);
            if let Err(e) = self.send(&pending, *partition, &buf[key.clone()], value) {
                pending.settle(records.len() - i, None);
                return Err(e);
            }
        }
        Ok(self.acks(pending, records.len()))
    }
}

/// The acknowledgements one `publish` waits for.
struct Acks {
    pending: Arc<Pending>,
    count: usize,
    topic: String,
    deadline: Instant,
    timeout: Duration,
}

impl Published for Acks {
    fn wait(self: Box<Self>) -> Result<(), String> {
        let mut s = self.pending.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.0 > 0 {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{} of {} changes not acknowledged by {} within {:?}",
                    s.0, self.count, self.topic, self.timeout
                ));
            }
            s = self
                .pending
                .done
                .wait_timeout(s, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        match s.1.take() {
            Some(e) => Err(format!("{} refused a change: {e}", self.topic)),
            None => Ok(()),
        }
    }
}

impl Drop for ChangelogProducer {
    fn drop(&mut self) {
        let _ = self.producer.flush(Duration::from_secs(5));
    }
}

/// The partition count of `topic` (`None`: the cluster does not know it).
pub fn partition_count<C: rdkafka::consumer::ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    topic: &str,
) -> Result<Option<usize>, KafkaError> {
    let meta = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| KafkaError::Client(format!("metadata of {topic}: {e}")))?;
    Ok(meta
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len())
        .filter(|n| *n > 0))
}

/// Creates the changelog topic: compacted, `partitions` partitions. One that exists
/// already is left as it is.
pub fn create_topic(kafka: &KafkaConfig, topic: &str, partitions: usize) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = super::client_config(kafka)
        .create()
        .map_err(|e| KafkaError::Client(format!("admin client: {e}")))?;
    let new = NewTopic::new(
        topic,
        partitions as i32,
        TopicReplication::Fixed(kafka.changelog.replication_factor),
    )
    .set("cleanup.policy", "compact");
    let opts = AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(10)))
        .request_timeout(Some(Duration::from_secs(15)));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| KafkaError::Client(format!("admin runtime: {e}")))?;
    let how = format!(
        "create it with {partitions} partitions and cleanup.policy=compact, or let dedupd create it (CreateTopics, the cluster's ACLs permitting)"
    );
    let created = runtime
        .block_on(admin.create_topics([&new], &opts))
        .map_err(|e| {
            KafkaError::Client(format!(
                "changelog topic {topic} is missing and creating it failed: {e}; {how}"
            ))
        })?;
    for result in created {
        match result {
            Ok(_) => {
                tracing::info!(%topic, partitions, "changelog topic created (cleanup.policy=compact)")
            }
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(KafkaError::Client(format!(
                    "changelog topic {topic} is missing and creating it failed: {code}; {how}"
                )))
            }
        }
    }
    Ok(())
}

/// What one restore did.
#[derive(Debug, Default, Clone)]
pub struct Restored {
    /// Each partition's end offset when the restore began: its checkpoint now.
    pub ends: Vec<(i32, i64)>,
    /// Changelog records read and replayed.
    pub changes: u64,
    /// Records not read because this data directory's checkpoint covers them.
    pub skipped: u64,
    /// Tombstones read (not replayed: they mark expired claims the cleaner may drop).
    pub tombstones: u64,
    /// Values skipped because a member that had lost the partition published them after
    /// its new owner's fence.
    pub fenced: u64,
    /// Messages handlers emitted that the changelog holds with no tombstone (not relayed
    /// yet, as far as it knows), put back into this member's outbox.
    pub emitted: u64,
    /// Quarantine and dead-letter records the changelog holds with no tombstone, put
    /// into this member's tables.
    pub records: u64,
    pub elapsed: Duration,
}

/// The checkpoint key of a changelog partition.
pub fn checkpoint_key(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

/// The key under which a changelog checkpoint's fence is kept: the newest fence before
/// the checkpoint's offset, which a restore starting there needs.
pub fn fence_checkpoint_key(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}/fence")
}

/// Records each partition's end offset as this data directory's checkpoint. Call only
/// when every change before those offsets is durable here (after a restore, or once the
/// partitions' in-flight work drained): the next restore reads from there.
pub fn checkpoint<C: rdkafka::consumer::ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    ledger: &Ledger,
    topic: &str,
    partitions: &[i32],
) -> Result<(), KafkaError> {
    for &p in partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(|e| KafkaError::Client(format!("end offset of {topic}/{p}: {e}")))?;
        ledger
            .set_changelog_checkpoint(&checkpoint_key(topic, p), high.max(0) as u64)
            .map_err(|e| KafkaError::Ledger(e.to_string()))?;
    }
    Ok(())
}

/// Replays the given partitions of the changelog into the ledger, from this data
/// directory's checkpoint (or the first record) to the end offset read at the start,
/// waits until every change is durable, and moves the checkpoints to those end offsets.
/// Partitions are read one after another (one fetch stream at a time: with the mock
/// broker, reading 23 partitions at once replayed ~200k changes/s against ~590k for one);
/// the ledger applies one partition's changes while the next is read.
pub fn restore(
    ledger: &Ledger,
    sub: &Arc<Subscriber>,
    kafka: &KafkaConfig,
    topic: &str,
    partitions: &[i32],
) -> Result<Restored, KafkaError> {
    let started = Instant::now();
    let client = |e: RdError| KafkaError::Client(format!("restoring from {topic}: {e}"));
    let consumer: BaseConsumer = super::client_config(kafka)
        .set("group.id", format!("{}-restore", topic))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .create()
        .map_err(client)?;
    let mut replay = Replay {
        ledger,
        sub,
        ack: unbounded(),
        staged: (0..ledger.shard_count()).map(|_| Vec::new()).collect(),
        submitted: 0,
        settled: 0,
    };
    let deadline = Instant::now() + kafka.changelog.restore_timeout;
    let mut last_log = Instant::now();
    let (mut ends, mut skipped, mut tombstones, mut fenced) = (Vec::new(), 0u64, 0u64, 0u64);
    // Each partition's newest fence at its end offset, stored with its checkpoint.
    let mut fences = Vec::with_capacity(partitions.len());
    let mut emitted = Unrelayed::default();
    // The newest copy of each quarantine and dead-letter record (`None` body: removed).
    let mut kept: std::collections::HashMap<Vec<u8>, RecordCopy> = Default::default();
    let ledger_err = |e: crate::ledger::LedgerError| KafkaError::Ledger(e.to_string());
    for &p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(30))
            .map_err(client)?;
        ends.push((p, high));
        let mut from = match ledger
            .changelog_checkpoint(&checkpoint_key(topic, p))
            .map_err(ledger_err)?
        {
            Some(c) if c as i64 <= high => c as i64,
            Some(c) => {
                tracing::warn!(subscriber = %sub.name, %topic, partition = p, checkpoint = c, end = high,
                    "the changelog partition ends before this data directory's checkpoint (was the topic deleted and created again?): replaying it whole");
                0
            }
            None => 0,
        };
        if low > from {
            tracing::warn!(subscriber = %sub.name, %topic, partition = p, first_offset = low,
                "the changelog partition does not start at offset 0: changes before it were deleted (a retention setting, or a broker that keeps only recent data) and the claims and state they held are not restored; a changelog topic needs cleanup.policy=compact and no retention.ms");
            from = low;
        }
        skipped += (from - low).max(0) as u64;
        // The newest fence before `from`, as this data directory recorded it with its
        // checkpoint (a replay from the first record finds every fence itself).
        let mut fence = if from > 0 {
            ledger
                .changelog_checkpoint(&fence_checkpoint_key(topic, p))
                .map_err(ledger_err)?
                .unwrap_or(0)
        } else {
            0
        };
        if high <= from {
            fences.push((p, fence));
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Offset(from))
            .map_err(client)?;
        consumer.assign(&tpl).map_err(client)?;
        loop {
            if Instant::now() > deadline {
                return Err(KafkaError::Client(format!(
                    "restoring from {topic} took longer than kafka.changelog.restore_timeout ({:?}); {} changes replayed",
                    kafka.changelog.restore_timeout, replay.submitted
                )));
            }
            let Some(m) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = m.map_err(client)?;
            let offset = m.offset();
            let at = |e: String| {
                KafkaError::Client(format!("{topic} partition {p} offset {offset}: {e}"))
            };
            // The value under its epoch; `None` for a tombstone.
            let (epoch, payload) = match m.payload() {
                Some(v) => {
                    let (epoch, inner) = split_epoch(v).map_err(at)?;
                    (epoch, Some(inner))
                }
                None => (None, None),
            };
            if m.key().is_some_and(is_fence_key) {
                // A member took the partition over here: what an older owner publishes
                // from now on is not its to publish.
                fence = fence.max(offset.max(0) as u64);
            } else if epoch.is_some_and(|e| e < fence) {
                fenced += 1;
            } else if let Some(key) = m.key().filter(|k| is_record_key(k)) {
                let copy = match payload {
                    Some(value) => decode_record(value).map_err(at)?,
                    None => removed_record(key, p)
                        .ok_or_else(|| at("a record key of no known kind".into()))?,
                };
                kept.insert(key.to_vec(), copy);
            } else if let Some(key) = m.key().filter(|k| is_emitted_key(k)) {
                // An emitted message; its tombstone says the relay delivered it.
                match payload {
                    Some(value) => {
                        let mut message = decode_emitted(value).map_err(at)?.message;
                        message.changelog_partition = Some(p);
                        emitted.put(key, message);
                    }
                    None => emitted.relayed(key),
                }
            } else if let Some(value) = payload {
                replay.push(decode(value).map_err(at)?)?;
            } else {
                // Compaction's mark that an expired claim's record may go.
                tombstones += 1;
            }
            if last_log.elapsed() >= Duration::from_secs(5) {
                last_log = Instant::now();
                tracing::info!(subscriber = %sub.name, %topic, partition = p, changes = replay.submitted, "restoring from the changelog");
            }
            if offset + 1 >= high {
                break;
            }
        }
        fences.push((p, fence));
    }
    consumer.unassign().map_err(client)?;
    replay.finish()?;
    // After the claims: a row relayed from here is one whose claim this member holds.
    let emitted = ledger
        .outbox_restore(&sub.name, emitted.unrelayed())
        .map_err(ledger_err)?;
    let records = ledger
        .records_restore(&sub.name, kept.into_values().collect())
        .map_err(ledger_err)?;
    // Each checkpoint with its fence, in one transaction: a restore from a checkpoint
    // must start from the fence that was newest there.
    let mut entries = Vec::with_capacity(2 * ends.len());
    for &(p, high) in &ends {
        let fence = fences.iter().find(|(q, _)| *q == p).map_or(0, |f| f.1);
        entries.push((checkpoint_key(topic, p), high.max(0) as u64));
        entries.push((fence_checkpoint_key(topic, p), fence));
    }
    ledger
        .set_changelog_checkpoints(entries)
        .map_err(ledger_err)?;
    Ok(Restored {
        ends,
        changes: replay.submitted,
        skipped,
        tombstones,
        fenced,
        emitted,
        records,
        elapsed: started.elapsed(),
    })
}

/// Emitted messages read in a restore, in offset order, less those relayed since.
#[derive(Default)]
struct Unrelayed {
    messages: Vec<Option<crate::effects::OutboxMessage>>,
    at: std::collections::HashMap<Vec<u8>, usize>,
}

impl Unrelayed {
    fn put(&mut self, key: &[u8], message: crate::effects::OutboxMessage) {
        self.relayed(key);
        self.at.insert(key.to_vec(), self.messages.len());
        self.messages.push(Some(message));
    }

    fn relayed(&mut self, key: &[u8]) {
        if let Some(i) = self.at.remove(key) {
            self.messages[i] = None;
        }
    }

    fn unrelayed(self) -> Vec<crate::effects::OutboxMessage> {
        self.messages.into_iter().flatten().collect()
    }
}

/// Restore jobs on their way into the ledger.
struct Replay<'a> {
    ledger: &'a Ledger,
    sub: &'a Arc<Subscriber>,
    ack: (
        crossbeam_channel::Sender<Vec<Done>>,
        crossbeam_channel::Receiver<Vec<Done>>,
    ),
    staged: Vec<Vec<Job>>,
    submitted: u64,
    settled: u64,
}

impl Replay<'_> {
    /// Places a change as its message was placed and submits it with others of its shard.
    fn push(&mut self, change: Change) -> Result<(), KafkaError> {
        let entity = change.entity.clone();
        let mut job = Job::restore(self.submitted, self.sub.id, change, self.ack.0.clone());
        let shard = self.ledger.place(self.sub, &mut job, entity);
        self.staged[shard].push(job);
        self.submitted += 1;
        if self.staged[shard].len() >= CHUNK {
            self.ledger
                .submit(shard, std::mem::take(&mut self.staged[shard]))
                .map_err(|e| KafkaError::Ledger(e.to_string()))?;
        }
        while let Ok(d) = self.ack.1.try_recv() {
            self.settle(d)?;
        }
        if self.submitted - self.settled > MAX_IN_FLIGHT as u64 {
            self.flush()?;
            self.wait_until((MAX_IN_FLIGHT / 2) as u64)?;
        }
        Ok(())
    }

    fn settle(&mut self, dones: Vec<Done>) -> Result<(), KafkaError> {
        for d in dones {
            if let Outcome::Failed { reason } = d.outcome {
                return Err(KafkaError::Ledger(reason));
            }
            self.settled += 1;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), KafkaError> {
        flush(self.ledger, &mut self.staged)
    }

    /// Waits until at most `left` jobs are unsettled.
    fn wait_until(&mut self, left: u64) -> Result<(), KafkaError> {
        while self.submitted - self.settled > left {
            let d = self
                .ack
                .1
                .recv_timeout(Duration::from_secs(60))
                .map_err(|_| KafkaError::Ledger("restore outcomes stopped arriving".into()))?;
            self.settle(d)?;
        }
        Ok(())
    }

    /// Submits what is staged and waits until every change is durable.
    fn finish(&mut self) -> Result<(), KafkaError> {
        self.flush()?;
        self.wait_until(0)
    }
}

fn flush(ledger: &Ledger, staged: &mut [Vec<Job>]) -> Result<(), KafkaError> {
    for (shard, jobs) in staged.iter_mut().enumerate() {
        if !jobs.is_empty() {
            ledger
                .submit(shard, std::mem::take(jobs))
                .map_err(|e| KafkaError::Ledger(e.to_string()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    fn change() -> Change {
        let mut c = Change {
            key: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            id: "m-1".into(),
            fingerprint: 9,
            processed_at_ms: 1_700_000_000_000,
            expires_at_ms: 1_700_086_400_000,
            handler_version: 3,
            entity: Some("order-7".into()),
            state: Default::default(),
            uniques: Default::default(),
            versions: Default::default(),
            emitted: Vec::new(),
            origin: None,
            snapshot: false,
            record: None,
        };
        c.state.insert(b"count".to_vec(), Some(b"2".to_vec()));
        c.state.insert(b"old".to_vec(), None);
        c.uniques.insert(b"label\0order-7".to_vec());
        c.versions.insert("v".into(), 11);
        c
    }

    #[test]
    fn record_copies_round_trip_and_their_tombstones_name_them() {
        let copy = RecordCopy {
            kind: RecordKind::DeadLetter,
            key: 0xfeed_0000_0000_0000_0000_0000_0000_beef,
            fingerprint: 0x1234_5678_9abc_def0,
            route: 42,
            body: Some(br#"{"id":"m-1","count":2}"#.to_vec()),
            partition: 5,
        };
        let value = encode_record(&copy).unwrap();
        let back = decode_record(&value).unwrap();
        // The partition is the changelog partition's, not part of the value.
        assert_eq!(
            back,
            RecordCopy {
                partition: 0,
                ..copy.clone()
            }
        );
        let key = record_copy_key(&copy);
        assert!(is_record_key(&key) && !is_emitted_key(&key) && !is_snapshot_key(&key));
        assert!(!is_record_key(&record_key(&change())));
        let gone = removed_record(&key, 5).unwrap();
        assert_eq!(
            (
                gone.kind,
                gone.key,
                gone.fingerprint,
                gone.body,
                gone.partition
            ),
            (copy.kind, copy.key, copy.fingerprint, None, 5)
        );
        let quarantine = RecordCopy {
            kind: RecordKind::Quarantine,
            ..copy.clone()
        };
        assert_ne!(
            record_copy_key(&quarantine),
            key,
            "the kind is part of the key"
        );
        let mut bad = key;
        bad[1] = b'x';
        assert!(removed_record(&bad, 5).is_none());
        assert!(decode_record(&encode(&change()).unwrap()).is_err());
        assert!(decode_record(&value[..value.len() - 1]).is_err());
    }

    #[test]
    fn values_under_an_epoch_split_back_and_older_values_have_none() {
        let plain = encode(&change()).unwrap();
        assert_eq!(split_epoch(&plain).unwrap(), (None, &plain[..]));
        let mut under = vec![EPOCH_FORMAT];
        under.extend_from_slice(&7u64.to_be_bytes());
        under.extend_from_slice(&plain);
        let (epoch, inner) = split_epoch(&under).unwrap();
        assert_eq!((epoch, decode(inner).unwrap()), (Some(7), change()));
        assert!(split_epoch(&under[..5])
            .unwrap_err()
            .contains("epoch of 4 bytes"));
        // A build without fences refuses such a value by its format, not as damage.
        assert!(decode(&under).unwrap_err().contains("upgrade dedupd"));
        let f = fence_key(1);
        assert!(is_fence_key(&f));
        assert!(!is_emitted_key(&f) && !is_snapshot_key(&f) && !is_record_key(&f));
        assert!(!is_fence_key(&record_key(&change())));
        assert_ne!(fence_key(1), fence_key(2));
    }

    #[test]
    fn a_change_survives_its_record_encoding() {
        let c = change();
        assert_eq!(decode(&encode(&c).unwrap()).unwrap(), c);
    }

    #[test]
    fn emitted_records_round_trip_and_a_tombstone_takes_one_back() {
        let message = |id: &str| crate::effects::OutboxMessage {
            id: id.into(),
            topic: "payments.captured".into(),
            key: Some("p-1".into()),
            headers: vec![("h".into(), "v".into())],
            payload: vec![0, 255, 7],
            changelog_partition: Some(3),
        };
        let e = Emitted {
            expires_at_ms: 42,
            message: message("m-1#emit#1"),
        };
        let bytes = encode_emitted(&e).unwrap();
        // Publishing encodes a borrowed message into one buffer after other records:
        // the same bytes.
        let mut buf = encode(&change()).unwrap();
        let start = buf.len();
        let borrowed = EmittedRef {
            expires_at_ms: 42,
            message: &e.message,
        };
        encode_value_into(&mut buf, EMITTED_FORMAT, EMITTED, &borrowed).unwrap();
        assert_eq!(&buf[start..], &bytes[..]);
        assert_eq!(decode(&buf[..start]).unwrap(), change());
        let back = decode_emitted(&bytes).unwrap();
        assert_eq!(back.expires_at_ms, 42);
        // The partition is where the record is, not part of it.
        assert_eq!(back.message.changelog_partition, None);
        assert_eq!(back.message.payload, e.message.payload);
        assert!(decode(&bytes).unwrap_err().contains("upgrade dedupd"));
        assert!(decode_emitted(&encode(&change()).unwrap()).is_err());
        assert!(decode_emitted(&bytes[..bytes.len() - 1]).is_err());

        let (k1, k2) = (emitted_key("m-1#emit#1"), emitted_key("m-1#emit#2"));
        assert_ne!(k1, k2);
        assert!(is_emitted_key(&k1) && !is_snapshot_key(&k1));
        assert!(!is_emitted_key(&record_key(&change())));
        let mut u = Unrelayed::default();
        u.put(&k1, message("m-1#emit#1"));
        u.put(&k2, message("m-1#emit#2"));
        u.relayed(&k1);
        u.put(&k1, message("m-1#emit#1")); // emitted again after its claim expired
        u.relayed(&emitted_key("never emitted"));
        let ids: Vec<String> = u.unrelayed().into_iter().map(|m| m.id).collect();
        assert_eq!(ids, ["m-1#emit#2", "m-1#emit#1"]);
    }

    #[test]
    fn damaged_or_foreign_records_are_refused_with_the_reason() {
        let bytes = encode(&change()).unwrap();
        assert!(decode(&bytes[..bytes.len() - 3]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).unwrap_err().contains("after the change"));
        let mut newer = bytes;
        newer[0] = 2;
        assert!(decode(&newer).unwrap_err().contains("upgrade dedupd"));
        assert!(decode(&[]).is_err());
    }
}
