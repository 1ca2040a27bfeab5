//! Publishing to the changelog: a batch's records under this member's epochs, fences on
//! assignment, tombstones, and the acknowledgements a shard waits for before it commits.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;

use super::record::{
    emitted_key, encode_value_into, fence_key, record_copy_key, record_key, snapshot_key,
    EmittedRef, CHANGE, EMITTED, EMITTED_FORMAT, EPOCH_FORMAT, FENCE_FORMAT, FORMAT, RECORD,
    RECORD_FORMAT,
};
use super::ChangelogError;
use crate::ledger::changelog::{Change, ChangelogSink, Published, SinkError};
use crate::ledger::Origin;
use crate::source::kafka::{producer_config, KafkaConfig, KafkaError};

/// Acknowledgements still awaited by one `publish` call, and its first error.
#[derive(Default)]
struct Pending {
    state: Mutex<(usize, Option<RdError>)>,
    done: Condvar,
    /// (partition, offset) of every acknowledged record, when asked for (fences).
    offsets: Option<Mutex<Vec<(i32, i64)>>>,
}

impl Pending {
    fn settle(&self, n: usize, error: Option<RdError>) {
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
pub(crate) type Acked = Arc<Mutex<std::collections::HashMap<i32, i64>>>;

struct PublishContext {
    acked: Acked,
}

impl ClientContext for PublishContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::source::kafka::logging::log(level, fac, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        crate::source::kafka::logging::error(&error, reason);
    }
}

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
        pending.settle(1, result.as_ref().err().map(|(e, _)| e.clone()));
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
    pub(crate) fn acked(&self) -> Acked {
        self.producer.context().acked.clone()
    }

    pub fn new(kafka: &KafkaConfig, topic: String) -> Result<ChangelogProducer, KafkaError> {
        let timeout = kafka.changelog.publish_timeout;
        let mut config = producer_config(kafka);
        // A shard waits for these acknowledgements: send at once rather than linger.
        config
            .set("linger.ms", "0")
            .set("message.timeout.ms", timeout.as_millis().max(1).to_string());
        let producer = config
            .create_with_context(PublishContext {
                acked: Acked::default(),
            })
            .map_err(|source| KafkaError::Client {
                what: "changelog producer".into(),
                source,
            })?;
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
    pub fn fence(&self, partitions: &[i32]) -> Result<Vec<(i32, u64)>, ChangelogError> {
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
        self.acks(pending.clone(), partitions.len())
            .acknowledged()?;
        let offsets = pending
            .offsets
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default();
        let mut fenced = Vec::with_capacity(partitions.len());
        let mut epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        for &p in partitions {
            let Some(&(_, offset)) = offsets.iter().find(|(q, _)| *q == p) else {
                return Err(ChangelogError::NoFenceOffset {
                    topic: self.topic.clone(),
                    partition: p,
                });
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
    ) -> Result<(), ChangelogError> {
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
                Err((source, _)) => {
                    return Err(ChangelogError::Produce {
                        topic: self.topic.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// The acknowledgements of `count` records sent with `pending`.
    fn acks(&self, pending: Arc<Pending>, count: usize) -> Acks {
        Acks {
            pending,
            count,
            topic: self.topic.clone(),
            // Deliveries fail on their own once `message.timeout.ms` passes; the margin
            // covers the report's way back.
            deadline: Instant::now() + self.timeout + Duration::from_secs(5),
            timeout: self.timeout,
        }
    }

    /// Produces a tombstone (a record with no value) for each record key to `partition`,
    /// so the broker's log cleaner drops every record with that key.
    pub(crate) fn tombstone(
        &self,
        partition: i32,
        keys: &[Vec<u8>],
    ) -> Result<Acks, ChangelogError> {
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
    fn publish(&self, changes: &[Change]) -> Result<Box<dyn Published>, SinkError> {
        Ok(Box::new(self.publish_changes(changes)?))
    }
}

impl ChangelogProducer {
    /// [`ChangelogSink::publish`]: the records of `changes`, sent.
    fn publish_changes(&self, changes: &[Change]) -> Result<Acks, ChangelogError> {
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
        // A value starts with this member's epoch in its partition (see the changelog's
        // module docs, "Fences").
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
                return Err(ChangelogError::NotKafka {
                    id: change.id.clone(),
                });
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
pub(crate) struct Acks {
    pending: Arc<Pending>,
    count: usize,
    topic: String,
    deadline: Instant,
    timeout: Duration,
}

impl Published for Acks {
    fn wait(self: Box<Self>) -> Result<(), SinkError> {
        Ok(self.acknowledged()?)
    }
}

impl Acks {
    /// Returns once every record is acknowledged, or why one is not.
    pub(crate) fn acknowledged(self) -> Result<(), ChangelogError> {
        let mut s = self.pending.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.0 > 0 {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ChangelogError::NotAcknowledged {
                    left: s.0,
                    count: self.count,
                    topic: self.topic.clone(),
                    timeout: self.timeout,
                });
            }
            s = self
                .pending
                .done
                .wait_timeout(s, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        match s.1.take() {
            Some(source) => Err(ChangelogError::Refused {
                topic: self.topic.clone(),
                source,
            }),
            None => Ok(()),
        }
    }
}

impl Drop for ChangelogProducer {
    fn drop(&mut self) {
        let _ = self.producer.flush(Duration::from_secs(5));
    }
}
