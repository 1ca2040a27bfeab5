//! The changelog side of a consumer (`changelog = true`): newly assigned partitions are
//! fenced and restored before any of their messages is taken, checkpoints move while they
//! are owned and once they drain, a lost partition's checkpoint is reset, and the outbox is
//! relayed before revoked partitions are released. The format, the producer and the
//! restore itself are in `source/kafka/changelog/`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::BaseConsumer;
use rdkafka::topic_partition_list::TopicPartitionList;

use super::{SourceStats, Worker, WorkerContext};
use crate::ledger::Ledger;
use crate::source::kafka::{
    changelog, compaction, KafkaConfig, KafkaConfigError, KafkaError, SubscriptionConfig,
};

/// What a worker needs to restore newly assigned partitions and move their checkpoints.
pub(super) struct Changelog {
    kafka: KafkaConfig,
    topic: String,
    /// The publisher, for the fences of newly assigned partitions.
    sink: Arc<changelog::ChangelogProducer>,
    /// The highest changelog offset acknowledged per partition.
    acked: changelog::Acked,
    /// Checkpoints waiting for their messages: (slot, local number, changelog offset) —
    /// once every message of the slot below the local number is released, every change
    /// before the offset is committed here.
    pending: Vec<(u64, u64, i64)>,
    /// Where each partition's checkpoint is (as far as this member moved it).
    moved_to: HashMap<i32, i64>,
    last: Instant,
    /// The partitions this member owns, for the compaction thread.
    pub(super) owned: Arc<Mutex<Vec<i32>>>,
    /// Held by a compaction snapshot round; a revoke takes it to remove partitions from
    /// `owned`, so no snapshot of a partition is published once it is released.
    pub(super) gate: Arc<Mutex<()>>,
    /// Stopped (and joined) when the subscription stops.
    pub(super) compaction: Option<compaction::CompactionThread>,
}

impl Worker {
    /// Moves the changelog checkpoints of these partitions (all when `None`) to the
    /// changelog's end: call only after their in-flight work drained, so every change
    /// before the end is durable here. A failure is logged: the next restore reads more.
    pub(super) fn checkpoint(&self, consumer: &BaseConsumer<WorkerContext>, slots: &[u64]) {
        let Some(c) = &self.changelog else {
            return;
        };
        if self.fatal.is_some() {
            return;
        }
        let partitions: Vec<i32> = slots
            .iter()
            .filter_map(|s| self.parts.get(s).map(|p| p.partition))
            .collect();
        if let Err(e) = changelog::checkpoint(consumer, &self.ledger, &c.topic, &partitions) {
            tracing::warn!(subscriber = %self.sub.name, topic = %c.topic, error = %e,
                "changelog checkpoint not moved; the next restore of these partitions reads more of the changelog");
        }
    }

    /// Moves changelog checkpoints while partitions are owned, so a restart after a crash
    /// reads only what came after the last one. Every `checkpoint_interval` it notes, per
    /// partition, the highest acknowledged changelog offset and the next message's local
    /// number (in that order: a change acknowledged before the note belongs to a message
    /// received before it); once every message below that number is released (its outcome
    /// durable), every change up to the offset is committed here and the checkpoint moves.
    pub(super) fn checkpoint_owned(&mut self) {
        if self.fatal.is_some() {
            return;
        }
        let Some(c) = &mut self.changelog else {
            return;
        };
        {
            let mut owned = c.owned.lock().unwrap_or_else(|p| p.into_inner());
            if owned.len() != self.parts.len()
                || self.parts.values().any(|p| !owned.contains(&p.partition))
            {
                *owned = self.parts.values().map(|p| p.partition).collect();
                owned.sort_unstable();
            }
        }
        if c.last.elapsed() >= c.kafka.changelog.checkpoint_interval {
            c.last = Instant::now();
            let acked = c.acked.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for (slot, p) in &self.parts {
                let Some(&top) = acked.get(&p.partition) else {
                    continue;
                };
                let at = c.moved_to.get(&p.partition).copied().unwrap_or(-1);
                if top + 1 > at && !c.pending.iter().any(|(s, _, o)| s == slot && *o > top) {
                    c.pending.push((*slot, p.tracker.next_local(), top + 1));
                }
            }
        }
        let parts = &self.parts;
        let (ledger, topic, sub) = (&self.ledger, &c.topic, &self.sub.name);
        let mut moved = Vec::new();
        c.pending.retain(|&(slot, mark, offset)| {
            let Some(p) = parts.get(&slot) else {
                return false; // revoked: its revoke moved the checkpoint if it drained
            };
            if p.tracker.released() < mark {
                return true;
            }
            let key = changelog::checkpoint_key(topic, p.partition);
            match ledger.set_changelog_checkpoint(&key, offset as u64) {
                Ok(()) => {
                    c.moved_to.insert(p.partition, offset);
                    moved.push((p.partition, offset));
                }
                Err(e) => tracing::warn!(subscriber = %sub, %topic, error = %e, "changelog checkpoint not moved"),
            }
            false
        });
        if !moved.is_empty() {
            tracing::debug!(subscriber = %sub, %topic, ?moved, "changelog checkpoints moved");
        }
    }

    /// Restores newly assigned partitions from the changelog before any of their messages
    /// is taken: a partition becomes this member's only once its claims and state are
    /// here. On failure the partitions are not taken and the subscription stops.
    pub(super) fn restore(&mut self, tpl: &TopicPartitionList) -> bool {
        let Some(c) = &self.changelog else {
            return true;
        };
        let partitions: Vec<i32> = tpl
            .elements()
            .iter()
            .filter(|e| self.slot_of(e.topic(), e.partition()).is_none())
            .map(|e| e.partition())
            .collect();
        if partitions.is_empty() || self.fatal.is_some() {
            return self.fatal.is_none();
        }
        let topic = c.topic.clone();
        // Fenced first, so the restore below reads past the fence: what a former owner
        // still publishes after it is skipped by every restore, this one included.
        match c.sink.fence(&partitions) {
            Ok(epochs) => {
                tracing::debug!(subscriber = %self.sub.name, %topic, ?epochs, "changelog partitions fenced");
            }
            Err(e) => {
                tracing::error!(subscriber = %self.sub.name, %topic, ?partitions, error = %e,
                    "fencing assigned partitions in the changelog failed; the subscription stops");
                self.fatal = Some(format!("changelog fence: {e}"));
                return false;
            }
        }
        let restored = changelog::restore(&self.ledger, &self.sub, &c.kafka, &topic, &partitions);
        match restored {
            Ok(r) => {
                if let Some(c) = &mut self.changelog {
                    c.moved_to.extend(r.ends.iter().copied());
                }
                self.stats
                    .restored_changes
                    .fetch_add(r.changes, Ordering::Relaxed);
                self.stats
                    .restored_emitted
                    .fetch_add(r.emitted, Ordering::Relaxed);
                self.stats
                    .restored_records
                    .fetch_add(r.records, Ordering::Relaxed);
                metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_RESTORED_TOTAL,
                    "subscriber" => self.sub.name.to_string())
                .increment(r.changes);
                let rate = r.changes as f64 / r.elapsed.as_secs_f64().max(1e-6);
                tracing::info!(subscriber = %self.sub.name, %topic, ?partitions,
                    changes = r.changes, covered_by_checkpoint = r.skipped, fenced = r.fenced,
                    emitted_not_relayed = r.emitted, records = r.records,
                    elapsed_ms = r.elapsed.as_millis() as u64,
                    changes_per_sec = rate as u64, "partitions restored from the changelog");
                true
            }
            Err(e) => {
                tracing::error!(subscriber = %self.sub.name, %topic, ?partitions, error = %e,
                    "restoring assigned partitions from the changelog failed; the subscription stops");
                self.fatal = Some(format!("changelog restore: {e}"));
                false
            }
        }
    }

    /// A member that lost partitions (its session expired: another member may own them
    /// and have fenced them already) may have moved their checkpoints past changes it
    /// does not hold — the new owner's, published after its fence. The next restore of
    /// these partitions here replays them whole instead of trusting such a checkpoint.
    pub(super) fn forget_checkpoints(&mut self, tpl: &TopicPartitionList) {
        let Some(c) = &mut self.changelog else {
            return;
        };
        for e in tpl.elements() {
            let p = e.partition();
            let key = changelog::checkpoint_key(&c.topic, p);
            match self.ledger.set_changelog_checkpoint(&key, 0) {
                Ok(()) => {
                    c.moved_to.remove(&p);
                }
                Err(err) => {
                    // The next restore here may then skip changes of the new owner.
                    tracing::warn!(subscriber = %self.sub.name, topic = %c.topic, partition = p, error = %err,
                        "the changelog checkpoint of a lost partition was not reset");
                }
            }
        }
    }

    /// With a changelog, the new owner of a revoked partition restores its claims and
    /// never runs its handler again, so what the handler emitted here must leave from
    /// here: the rows pending now (those of the drained partitions among them) are relayed
    /// before the partitions are released (up to `drain_timeout`). A row not relayed in
    /// time stays in this member's outbox and is relayed by it later.
    pub(super) fn relay_outbox_before_release(&self) {
        if self.changelog.is_none() || !self.ledger.outbox_relayed() {
            return;
        }
        let started = Instant::now();
        match self
            .ledger
            .wait_outbox_relayed(started + self.drain_timeout)
        {
            Ok((0, _)) => {}
            Ok((rows, true)) => {
                tracing::info!(subscriber = %self.sub.name, rows, ms = started.elapsed().as_millis() as u64,
                    "outbox rows relayed before the revoked partitions were released");
            }
            Ok((rows, false)) => {
                tracing::warn!(subscriber = %self.sub.name, rows, "outbox rows were not all relayed within kafka.drain_timeout before the revoked partitions were released; they stay in this member's outbox and are relayed by it later");
            }
            Err(e) => {
                tracing::warn!(subscriber = %self.sub.name, error = %e, "could not wait for the outbox relay before releasing revoked partitions");
            }
        }
    }
}

/// Creates the changelog topic if needed and installs its producer as the subscriber's
/// changelog sink: from here on every batch of the subscriber publishes before it commits.
pub(super) fn start_changelog(
    consumer: &BaseConsumer<WorkerContext>,
    ledger: &Arc<Ledger>,
    kafka: &KafkaConfig,
    subscription: &SubscriptionConfig,
    stats: Arc<SourceStats>,
) -> Result<Changelog, KafkaError> {
    let input = subscription
        .topics
        .first()
        .ok_or_else(|| KafkaError::from(KafkaConfigError::ChangelogTopics))?;
    let partitions = changelog::partition_count(consumer, input)?.ok_or_else(|| {
        KafkaError::from(KafkaConfigError::NoInputTopic {
            input: input.clone(),
        })
    })?;
    let topic = changelog::topic_name(&kafka.changelog.prefix, &subscription.subscriber);
    let existing = match changelog::partition_count(consumer, &topic)? {
        Some(n) => Some(n),
        None => {
            changelog::create_topic(kafka, &topic, partitions)?;
            changelog::partition_count(consumer, &topic)?
        }
    };
    if let Some(n) = existing {
        if n < partitions {
            return Err(KafkaConfigError::ChangelogPartitions {
                topic,
                found: n,
                input: input.clone(),
                partitions,
            }
            .into());
        }
    }
    let sink = Arc::new(changelog::ChangelogProducer::new(kafka, topic.clone())?);
    let acked = sink.acked();
    ledger.set_changelog(&subscription.subscriber, Some(sink.clone()))?;
    let owned = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(Mutex::new(()));
    let snapshots = compaction::Snapshots {
        ledger: ledger.clone(),
        sub: ledger.subscriber(&subscription.subscriber)?,
        owned: owned.clone(),
        gate: gate.clone(),
        // A snapshot waits for one batch of its shard and that batch's acknowledgements.
        timeout: kafka.changelog.publish_timeout + Duration::from_secs(30),
    };
    let compactor =
        compaction::Compactor::new(kafka, sink.clone(), topic.clone(), Some(snapshots))?;
    let name: Arc<str> = subscription.subscriber.as_str().into();
    let counted = name.to_string();
    let compaction = compaction::CompactionThread::spawn(
        compactor,
        name,
        kafka.changelog.compaction_interval,
        owned.clone(),
        move |c| {
            stats
                .changelog_tombstones
                .fetch_add(c.tombstones, Ordering::Relaxed);
            stats
                .changelog_snapshots
                .fetch_add(c.snapshots, Ordering::Relaxed);
            metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_TOMBSTONES_TOTAL,
                "subscriber" => counted.clone())
            .increment(c.tombstones);
            metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_SNAPSHOTS_TOTAL,
                "subscriber" => counted.clone())
            .increment(c.snapshots);
        },
    )
    .map_err(|source| KafkaError::Spawn {
        what: "changelog compaction",
        source,
    })?;
    tracing::info!(subscriber = %subscription.subscriber, %topic, partitions,
        compaction_interval = ?kafka.changelog.compaction_interval,
        "changelog on: claims and handler state are published before each commit and restored on assignment");
    Ok(Changelog {
        kafka: kafka.clone(),
        topic,
        sink,
        acked,
        pending: Vec::new(),
        moved_to: HashMap::new(),
        last: Instant::now(),
        owned,
        gate,
        compaction: Some(compaction),
    })
}
