//! The MQTT source (3.1.1 and 5): the only module that imports rumqttc.
//!
//! - `MqttConfig` (`config.rs`): the `[mqtt]` section — broker, protocol, client id,
//!   credentials, TLS, the window and `[[mqtt.subscription]]`s (topic filters ->
//!   subscriber), checked offline by `dedupd config check`.
//! - `session.rs`: rumqttc's 3.1.1 and 5 clients behind one face — a persistent session
//!   (clean session off, an MQTT 5 session expiry), manual acks, Receive Maximum, TLS on
//!   ring.
//! - `link.rs`: the task that polls the connection, reconnects with backoff, and the
//!   connection generation that keeps an ack on the connection its packet id belongs to.
//! - `consumer.rs`: every message keyed by the shared step
//!   ([`crate::source::delivery::route`]) and acknowledged (PUBACK) in arrival order
//!   only after its outcome is durable (G1); what cannot be keyed is kept as a dead-letter
//!   record first (MQTT has no reject), then acknowledged.
//! - [`run`] (here): the runtime, the `/readyz` probe, the stop.
//! - [`mod@bench`]: `dedupd mqtt-bench`, the source against a consume-only client.
//!
//! Keying: the topic is the envelope `key` (a `partition_key = { source = "envelope_key"
//! }` places handler state by topic); MQTT 5 user properties are the headers a `header`
//! key source reads; an `id` key source reads the topic level `id_topic_level` names;
//! `json_pointer`, `cloudevents` and `content_hash` read the payload as for every source.
//!
//! Several instances: each needs its own `client_id` (one session per id); a shared
//! subscription (`$share/<group>/<filter>`) makes the broker hand each message to one
//! member of the group. Instances do not share claims: a message the broker hands to
//! another member after a disconnect is processed there again unless they share a ledger
//! (docs/mqtt.md).

pub mod bench;
mod config;
mod consumer;
mod link;
mod session;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) use config::MqttConfig;

use crate::ledger::Ledger;
use crate::pipeline::{Cause, Shutdown};
use crate::source::settle::OutcomeStats;

/// Why the MQTT source stopped.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MqttError {
    /// The client could not run; check `mqtt.broker` and the network.
    #[error("mqtt client error: {0}")]
    Client(String),
    /// The ledger failed (G7): nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {0}")]
    Ledger(String),
    /// The section is unusable, or the broker refused what it asks for (credentials,
    /// client id, a topic filter): a restart does not fix it.
    #[error("{0}")]
    Config(String),
}

/// Live counters of one subscription.
#[derive(Debug, Default)]
pub(crate) struct MqttStats {
    /// Messages received from the broker (redeliveries included).
    pub(crate) received: AtomicU64,
    /// Messages received with the DUP flag: the broker sent them before (on a connection
    /// that was lost, or to a run that was killed).
    pub(crate) redelivered: AtomicU64,
    /// PUBACKs queued after the outcome was durable (processed, duplicate, quarantined,
    /// dead-lettered or rejected: MQTT has no reject).
    pub(crate) acked: AtomicU64,
    /// Outcomes made durable after the connection their message came on was lost: not
    /// acknowledged (its packet id is void); the broker delivers the message again.
    pub(crate) unacked_lost: AtomicU64,
    /// Durable outcomes by kind.
    pub(crate) outcomes: OutcomeStats,
}

/// What a stopped MQTT source did, all subscriptions together.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MqttSummary {
    pub received: u64,
    pub redelivered: u64,
    pub acked: u64,
    pub unacked_lost: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    pub rejected: u64,
    /// Connections made (the first included).
    pub(crate) connections: u64,
}

impl MqttSummary {
    fn add(&mut self, s: &MqttStats) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.received += get(&s.received);
        self.redelivered += get(&s.redelivered);
        self.acked += get(&s.acked);
        self.unacked_lost += get(&s.unacked_lost);
        let o = &s.outcomes;
        self.processed += get(&o.processed);
        self.duplicate += get(&o.duplicate);
        self.quarantined += get(&o.quarantined);
        self.dead_lettered += get(&o.dead_lettered);
        self.rejected += get(&o.rejected);
    }
}

/// `dedupd config check`: reads the password variable and the TLS files, builds the TLS
/// config, without connecting.
pub(crate) fn check_options(mqtt: &MqttConfig) -> Result<(), MqttError> {
    session::check(mqtt)
}

/// Runs the session until `shutdown` triggers; then drains, acknowledges what is durable
/// and disconnects (the session stays with the broker). A failure triggers `shutdown`.
pub fn run(
    ledger: Arc<Ledger>,
    mqtt: &MqttConfig,
    shutdown: &Shutdown,
) -> Result<MqttSummary, MqttError> {
    let stats: Vec<Arc<MqttStats>> = mqtt
        .subscriptions
        .iter()
        .map(|_| Arc::new(MqttStats::default()))
        .collect();
    run_with(ledger, mqtt, shutdown, &stats)
}

/// [`run`] counting into `stats`, one per subscription (`mqtt-bench` watches them).
pub(crate) fn run_with(
    ledger: Arc<Ledger>,
    mqtt: &MqttConfig,
    shutdown: &Shutdown,
    stats: &[Arc<MqttStats>],
) -> Result<MqttSummary, MqttError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("dedupd-mqtt")
        .enable_all()
        .build()
        .map_err(|e| MqttError::Client(format!("cannot start the mqtt runtime: {e}")))?;
    let result = rt.block_on(consumer::run(ledger, mqtt, shutdown, stats));
    if let Err(e) = &result {
        shutdown.trigger(Cause::Failed(e.to_string()));
    }
    let connections = result?;
    let mut summary = MqttSummary {
        connections,
        ..MqttSummary::default()
    };
    for s in stats {
        summary.add(s);
    }
    Ok(summary)
}
