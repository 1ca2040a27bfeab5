//! Compaction of a changelog: tombstones for the records of expired claims.
//!
//! Every processed message is one changelog record keyed by its claim key and processing
//! time, so no two records share a key and the broker's log cleaner, left alone, drops
//! nothing. Once a claim has expired its record restores nothing (a restore skips expired
//! claims), so when the record carries no handler state it may go: the member that owns
//! the partition produces a tombstone for its key, and the cleaner removes both (the
//! tombstone after the topic's `delete.retention.ms`).
//!
//! A pass over a partition reads from the **compactor group's** committed offset
//! (`<changelog topic>-compactor`; the first record when there is none) in offset order
//! and stops at the first record whose claim is not yet expired by `expiry_grace` — a
//! partition's records expire roughly in the order they were produced, since the TTL is
//! the subscriber's. Expired records without handler state get a tombstone; expired
//! records that wrote handler state are kept, since replaying them is how a new owner
//! gets that state (snapshots of state keys, which would let those go too, are not
//! built). Once the tombstones are acknowledged, the offset the pass stopped at is
//! committed for the compactor group, so the next pass — on this member or on whichever
//! member owns the partition next — starts there. A pass that dies midway leaves the
//! offset where it was, and the next one sends some tombstones again, which is harmless:
//! a tombstone of an expired claim is right whoever sends it and however often.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::Offset;

use super::changelog::{decode, ChangelogProducer};
use super::{KafkaConfig, KafkaError};
use crate::clock::{Clock, SystemClock};

/// Tombstones sent before a pass waits for their acknowledgements and commits its offset.
const TOMBSTONE_BATCH: usize = 8192;
/// How long a pass waits for the next record of a partition before it leaves the rest to
/// the next pass.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What a compaction pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    /// Records read.
    pub read: u64,
    /// Expired claims without handler state given a tombstone.
    pub tombstones: u64,
    /// Expired claims kept because their record carries handler state.
    pub kept_with_state: u64,
}

impl std::ops::AddAssign for Compacted {
    fn add_assign(&mut self, o: Compacted) {
        self.read += o.read;
        self.tombstones += o.tombstones;
        self.kept_with_state += o.kept_with_state;
    }
}

/// Compacts the partitions of one changelog topic.
pub struct Compactor {
    consumer: BaseConsumer,
    producer: Arc<ChangelogProducer>,
    topic: String,
    grace_ms: u64,
}

impl Compactor {
    pub fn new(
        kafka: &KafkaConfig,
        producer: Arc<ChangelogProducer>,
        topic: String,
    ) -> Result<Compactor, KafkaError> {
        let consumer: BaseConsumer = super::client_config(kafka)
            .set("group.id", format!("{topic}-compactor"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .create()
            .map_err(|e| KafkaError::Client(format!("compacting {topic}: {e}")))?;
        Ok(Compactor {
            consumer,
            producer,
            topic,
            grace_ms: kafka.changelog.expiry_grace.as_millis() as u64,
        })
    }

    /// One pass over `partitions` at wall-clock time `now_ms` (see the module's doc).
    /// Stops early, with what it committed so far, when `stop` is set.
    pub fn pass(
        &self,
        partitions: &[i32],
        now_ms: u64,
        stop: &AtomicBool,
    ) -> Result<Compacted, KafkaError> {
        let mut total = Compacted::default();
        for &p in partitions {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            total += self.partition(p, now_ms, stop)?;
        }
        Ok(total)
    }

    fn partition(&self, p: i32, now_ms: u64, stop: &AtomicBool) -> Result<Compacted, KafkaError> {
        let topic = &self.topic;
        let client = |e: rdkafka::error::KafkaError| {
            KafkaError::Client(format!("compacting {topic}/{p}: {e}"))
        };
        let (low, high) = self
            .consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(client)?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, p);
        let committed = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .map_err(client)?;
        let from = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        let mut done = Compacted::default();
        if from >= high {
            return Ok(done);
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(from))
            .map_err(client)?;
        self.consumer.assign(&tpl).map_err(client)?;
        let (mut keys, mut next) = (Vec::new(), from);
        let mut last_record = Instant::now();
        while next < high && !stop.load(Ordering::Relaxed) {
            let Some(m) = self.consumer.poll(Duration::from_millis(100)) else {
                if last_record.elapsed() > READ_TIMEOUT {
                    tracing::warn!(%topic, partition = p, offset = next,
                        "changelog compaction read nothing for {READ_TIMEOUT:?}; the next pass goes on from here");
                    break;
                }
                continue;
            };
            last_record = Instant::now();
            let m = m.map_err(client)?;
            done.read += 1;
            if let Some(value) = m.payload() {
                let change = match decode(value) {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(%topic, partition = p, offset = m.offset(), error = %e,
                            "changelog compaction stopped at a record it cannot read");
                        break;
                    }
                };
                if change.expires_at_ms.saturating_add(self.grace_ms) > now_ms {
                    break; // live: so, roughly, is everything after it
                }
                if change.has_effects() {
                    done.kept_with_state += 1;
                } else if let Some(key) = m.key() {
                    keys.push(key.to_vec());
                }
            }
            next = m.offset() + 1;
            if keys.len() >= TOMBSTONE_BATCH {
                done.tombstones += self.settle(p, &mut keys, next)?;
            }
        }
        done.tombstones += self.settle(p, &mut keys, next)?;
        self.consumer.unassign().map_err(client)?;
        Ok(done)
    }

    /// Sends the tombstones, waits for their acknowledgements, then commits `next` as the
    /// partition's compaction offset. Returns how many tombstones were sent.
    fn settle(&self, p: i32, keys: &mut Vec<Vec<u8>>, next: i64) -> Result<u64, KafkaError> {
        let topic = &self.topic;
        let n = keys.len() as u64;
        if n > 0 {
            self.producer
                .tombstone(p, keys)
                .and_then(|acks| acks.wait())
                .map_err(|e| KafkaError::Client(format!("tombstones to {topic}/{p}: {e}")))?;
            keys.clear();
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(next))
            .map_err(|e| KafkaError::Client(format!("compacting {topic}/{p}: {e}")))?;
        self.consumer
            .commit(&tpl, CommitMode::Sync)
            .map_err(|e| KafkaError::Client(format!("compaction offset of {topic}/{p}: {e}")))?;
        Ok(n)
    }
}

/// The compaction thread of one subscription: a pass over the partitions this member owns
/// every `compaction_interval`.
pub struct CompactionThread {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl CompactionThread {
    /// Starts compacting. `owned` is kept current by the consumer (the changelog
    /// partitions of the input partitions it holds); `tombstones` counts what was sent.
    pub fn spawn(
        compactor: Compactor,
        subscriber: Arc<str>,
        interval: Duration,
        owned: Arc<Mutex<Vec<i32>>>,
        tombstones: impl Fn(u64) + Send + 'static,
    ) -> std::io::Result<CompactionThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(format!("compact-{subscriber}"))
            .spawn(move || {
                let topic = compactor.topic.clone();
                while !flag.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    while started.elapsed() < interval && !flag.load(Ordering::Relaxed) {
                        std::thread::sleep(interval.min(Duration::from_millis(50)));
                    }
                    let partitions = owned.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if partitions.is_empty() || flag.load(Ordering::Relaxed) {
                        continue;
                    }
                    // The engine's time, which expired the claims (a jump of the wall
                    // clock does not move it).
                    let now_ms = SystemClock.now_ms();
                    match compactor.pass(&partitions, now_ms, &flag) {
                        Ok(c) => {
                            tombstones(c.tombstones);
                            if c.tombstones > 0 || c.kept_with_state > 0 {
                                tracing::info!(%subscriber, %topic, ?partitions, read = c.read,
                                    tombstones = c.tombstones, kept_with_state = c.kept_with_state,
                                    "changelog compacted: expired claims without handler state tombstoned");
                            } else {
                                tracing::debug!(%subscriber, %topic, ?partitions, read = c.read,
                                    "changelog compaction pass: nothing expired");
                            }
                        }
                        Err(e) => tracing::warn!(%subscriber, %topic, error = %e,
                            "changelog compaction pass failed; the next one goes on from the last committed offset"),
                    }
                }
            })?;
        Ok(CompactionThread {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for CompactionThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
