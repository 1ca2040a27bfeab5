//! One message on its way through the ledger: the [`Job`] a source submits, the
//! [`Outcome`] decided for it and the [`Done`] a shard sends back once it is durable, and
//! the [`Origin`] records name.

use std::sync::Arc;

use crossbeam_channel::Sender;

use super::changelog;
use super::{ClaimRecord, Placement, RecordKind, SubscriberId};

/// The decision for one message. Released to its source only after it is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// First delivery: claimed (and, with a handler, its writes committed).
    Processed,
    /// A live claim with the same payload fingerprint exists.
    Duplicate,
    /// A live claim exists with another payload fingerprint; the message is kept aside (G4).
    Quarantined { stored_fingerprint: u64 },
    /// The message could not be processed and was set aside with a reason, after
    /// `attempts` handler calls (the last one included).
    DeadLettered { reason: String, attempts: u32 },
    /// The input was unusable (malformed, no key, oversized key, unknown subscriber).
    Rejected { reason: String },
    /// The ledger failed to make the outcome durable; nothing may be acknowledged (G7).
    Failed { reason: String },
}

impl Outcome {
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Quarantined { .. } => "quarantined",
            Outcome::DeadLettered { .. } => "dead_lettered",
            Outcome::Rejected { .. } => "rejected",
            Outcome::Failed { .. } => "failed",
        }
    }

    pub(crate) fn reason(&self) -> Option<String> {
        match self {
            Outcome::Quarantined { stored_fingerprint } => Some(format!(
                "same id, different payload (stored fingerprint {stored_fingerprint:016x})"
            )),
            Outcome::DeadLettered { reason, .. }
            | Outcome::Rejected { reason }
            | Outcome::Failed { reason } => Some(reason.clone()),
            Outcome::Processed | Outcome::Duplicate => None,
        }
    }
}

/// A decided message: its source sequence number and outcome.
#[derive(Debug, Clone)]
pub struct Done {
    pub seq: u64,
    pub outcome: Outcome,
}

/// Where a shard sends outcomes after commit; one per source.
pub type AckSender = Sender<Vec<Done>>;

/// Where a message came from, as dead-letter and quarantine records name it. Formatted
/// only when such a record is written: the Kafka consumer makes one per message, and
/// formatting its topic, partition and offset each time was ~5 % of the consumer thread
/// (`dedupd kafka-bench`, `perf`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Any text (`http`, or a record's stored origin on replay).
    Text(Box<str>),
    /// A Kafka record: `kafka:<topic>/<partition>/<offset>`.
    Kafka {
        topic: Arc<str>,
        partition: i32,
        offset: i64,
    },
    /// A NATS JetStream message: `nats:<stream>/<stream sequence>`.
    Nats { stream: Arc<str>, sequence: u64 },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Text(t) => f.write_str(t),
            Origin::Kafka {
                topic,
                partition,
                offset,
            } => write!(f, "kafka:{topic}/{partition}/{offset}"),
            Origin::Nats { stream, sequence } => write!(f, "nats:{stream}/{sequence}"),
        }
    }
}

impl Origin {
    /// The Kafka partition the message came from: a Kafka origin, or a stored one read
    /// back as text (`kafka:<topic>/<partition>/<offset>`, a replayed record's).
    pub fn kafka_partition(&self) -> Option<i32> {
        match self {
            Origin::Kafka { partition, .. } => Some(*partition),
            Origin::Text(t) => {
                let rest = t.strip_prefix("kafka:")?;
                let mut parts = rest.rsplitn(3, '/');
                let (_offset, partition, topic) = (parts.next()?, parts.next()?, parts.next()?);
                if topic.is_empty() {
                    return None;
                }
                partition.parse().ok().filter(|p: &i32| *p >= 0)
            }
            Origin::Nats { .. } => None,
        }
    }
}

impl From<&str> for Origin {
    fn from(t: &str) -> Self {
        Origin::Text(t.into())
    }
}

impl From<String> for Origin {
    fn from(t: String) -> Self {
        Origin::Text(t.into_boxed_str())
    }
}

/// The kinds of work a [`Job`] carries to its shard; `decide` dispatches on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// A message from a source: claimed, given to the handler, committed.
    Deliver,
    /// A stored record replayed (`dedupd replay`, the admin API) as a delivery. A
    /// replayed quarantine replaces the live claim's payload instead of being quarantined
    /// again. `settle`: the record's sequence number when it lives on the job's shard, so
    /// that it is removed in the transaction of the job's final outcome (otherwise the
    /// caller removes it once that outcome is durable).
    Replay {
        kind: RecordKind,
        settle: Option<u64>,
    },
    /// A change replayed from a changelog ([`Job::restore`]): stored with no handler call.
    Restore(Box<changelog::Change>),
    /// The items a snapshot reads and publishes ([`Job::snapshot`]): nothing is stored.
    Snapshot(Box<changelog::Change>),
}

impl Work {
    /// A live claim with another payload is replaced, not quarantined: the replay of a
    /// quarantined message.
    pub(crate) fn replaces(&self) -> bool {
        matches!(
            self,
            Work::Replay {
                kind: RecordKind::Quarantine,
                ..
            }
        )
    }

    /// The stored record to remove with the job's final outcome, on this shard.
    pub(crate) fn settles(&self) -> Option<(RecordKind, u64)> {
        match self {
            Work::Replay {
                kind,
                settle: Some(seq),
            } => Some((*kind, *seq)),
            _ => None,
        }
    }
}

/// One keyed message on its way to a shard.
#[derive(Debug)]
pub struct Job {
    /// The source's sequence number, echoed in [`Done`].
    pub seq: u64,
    pub(crate) subscriber: SubscriberId,
    /// 128-bit hash of the idempotency key.
    pub(crate) key: u128,
    /// xxh3-64 of the canonical payload.
    pub(crate) fingerprint: u64,
    /// The idempotency key's text, kept in quarantine records.
    pub(crate) id: Box<str>,
    /// The canonical payload, kept in quarantine records (and given to handlers).
    pub(crate) payload: Box<[u8]>,
    pub(crate) ack: AckSender,
    /// Headers and partition key, for handlers and dead-letter records.
    pub headers: Vec<(String, String)>,
    pub(crate) partition_key: Option<String>,
    /// 1 on the first attempt; the shard counts retries.
    pub(crate) attempt: u32,
    /// When the source received the message (0: when the shard first decides it).
    pub(crate) received_at_ms: u64,
    /// Where the message came from (e.g. `kafka:orders/3/1234`), kept in dead-letter and
    /// quarantine records.
    pub origin: Option<Origin>,
    /// What the shard does with the job: a delivery, or one of the ledger's own kinds of
    /// work (a replayed record, a changelog change to restore, a snapshot to read).
    pub(crate) work: Work,
    /// How [`super::Ledger::place`] chose the shard.
    pub(crate) placement: Placement,
    /// The partition key's text under `Placement::Entity`: handler state is scoped to it.
    pub entity: Option<Box<str>>,
    /// The newest record the other shards hold for this key, once they were asked
    /// (`placement.rs`). While `Some`, this shard holds the key in the in-flight set.
    pub(crate) probed: Option<Option<ClaimRecord>>,
    /// When the job was built: its outcome's latency (handler retries included) is
    /// counted from here ([`SubscriberCounters::ack_latency_us`]).
    pub(crate) created: std::time::Instant,
}

impl Job {
    /// A first attempt with no headers or partition key.
    pub fn new(
        seq: u64,
        subscriber: SubscriberId,
        key: u128,
        fingerprint: u64,
        id: &str,
        payload: &[u8],
        ack: AckSender,
    ) -> Job {
        Job {
            seq,
            subscriber,
            key,
            fingerprint,
            id: id.into(),
            payload: payload.into(),
            ack,
            headers: Vec::new(),
            partition_key: None,
            attempt: 1,
            received_at_ms: 0,
            origin: None,
            work: Work::Deliver,
            placement: Placement::ByKey,
            entity: None,
            probed: None,
            created: std::time::Instant::now(),
        }
    }
}
