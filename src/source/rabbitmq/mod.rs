//! The RabbitMQ source (AMQP 0-9-1): the only module that imports lapin.
//!
//! - `RabbitMqConfig` (`config.rs`): the `[rabbitmq]` section — URI, credentials, TLS
//!   and `[[rabbitmq.binding]]`s (queue, subscriber, prefetch), checked offline by
//!   `dedupd config check`.
//! - `consumer.rs`: one channel and one consumer per binding — every message keyed by the
//!   shared step ([`crate::source::delivery::route`]), acknowledged (`basic.ack`,
//!   `multiple` over contiguous runs) only after its outcome is durable (G1), rejected
//!   without requeue (`basic.reject`, to the queue's dead-letter target) when it is
//!   dead-lettered or cannot be keyed, the in-flight window bounded by `basic.qos`
//!   `prefetch`, `basic.nack` with requeue for what a stop gives back.
//! - `acks.rs`: which durable deliveries to acknowledge now (the front run with one
//!   `multiple` ack; those behind an unfinished one wait up to 50 ms to join it).
//! - `outbox.rs`: with `[rabbitmq.outbox]`, what handlers emitted published to an
//!   exchange with publisher confirms, each row deleted once the server confirmed it.
//! - `bench.rs`: `dedupd rabbitmq-bench`, the source against a consume-only consumer.
//! - [`run`] (here): the connection and its reconnection with backoff, a probe for
//!   `/readyz` while it is down, the bindings of one connection (a session), the stop.
//!
//! Keying: a subscriber whose key source is `id` takes the `message_id` property as its
//! idempotency key; other key sources read headers (the `headers` table, values as text)
//! and payload as for every source. The routing key is the envelope `key` (a
//! `partition_key = { source = "envelope_key" }` places handler state by it).
//!
//! A lost connection, or a channel the server closed (a `consumer_timeout`, a deleted
//! queue), ends the session: the server requeues every message that was not acknowledged
//! and delivers it again, flagged `redelivered`, to the next session; the ledger answers
//! `duplicate` for what was durable already. Instances do not share claims: several
//! dedupd instances consuming one queue would process a retry or a redelivery that reached
//! the other one again. Several instances take one queue each, fed by a consistent-hash
//! exchange on `message_id`, so every copy of an id reaches the same instance
//! (docs/rabbitmq.md, "Several instances").

mod acks;
pub mod bench;
mod config;
mod consumer;
mod outbox;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

pub(crate) use config::{BindingConfig, RabbitMqConfig, RabbitOutboxConfig};

use crate::ledger::Ledger;
use crate::pipeline::{Cause, Shutdown};
use crate::source::settle::OutcomeStats;
use crate::telemetry::metric;

/// How long a stop waits for each answer of the server (a cancel, a channel's or the
/// connection's close) before it goes on without it: nothing durable depends on them, and
/// a server that stalled without closing the connection must not hold the stop. The run
/// loop's queue report waits no longer either (the loop notices a stop only between steps).
pub(crate) const STOP_REPLY: Duration = Duration::from_secs(2);

/// Waits for the server's answer to `what` at a stop, at most [`STOP_REPLY`]; a failure is
/// logged (debug: the stop goes on either way), a silence too (warn).
pub(crate) async fn at_stop<E: std::fmt::Display>(
    what: &str,
    queue: &str,
    answer: impl std::future::Future<Output = Result<(), E>>,
) {
    match tokio::time::timeout(STOP_REPLY, answer).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(queue, "rabbitmq {what} at stop: {e}"),
        Err(_) => tracing::warn!(
            queue,
            "the RabbitMQ server did not answer {what} within {STOP_REPLY:?}; stopping without it"
        ),
    }
}

/// Why the RabbitMQ source stopped.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitMqError {
    /// The server refused a queue operation (a missing queue with `declare = false`, a
    /// queue declared with other arguments, no permission); fix the queue or the section.
    #[error("rabbitmq: {0}")]
    Client(String),
    /// The ledger failed (G7): nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {0}")]
    Ledger(String),
    /// The section, or a file it names, is unusable.
    #[error("{0}")]
    Config(String),
}

/// Live counters of one binding (all sessions).
#[derive(Debug, Default)]
pub(crate) struct RabbitMqStats {
    /// Messages received from the server (redeliveries included).
    pub(crate) received: AtomicU64,
    /// Messages received with the `redelivered` flag: the server delivered them before.
    pub(crate) redelivered: AtomicU64,
    /// Messages acknowledged (outcome durable: processed, duplicate or quarantined); a
    /// `multiple` ack counts every message it covers.
    pub(crate) acked: AtomicU64,
    /// `basic.ack` frames sent for them (a `multiple` ack is one frame).
    pub(crate) ack_frames: AtomicU64,
    /// `basic.reject` without requeue sent (dead-lettered or rejected, kept in the
    /// ledger's dead letters first): to the queue's dead-letter exchange if it has one.
    pub(crate) dead_letter_rejects: AtomicU64,
    /// `basic.nack` with requeue sent (given back at stop, not durable).
    pub(crate) requeued: AtomicU64,
    /// Durable outcomes by kind.
    pub(crate) outcomes: OutcomeStats,
}

/// What a stopped RabbitMQ source did, all bindings together.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RabbitMqSummary {
    pub received: u64,
    pub redelivered: u64,
    pub acked: u64,
    pub(crate) ack_frames: u64,
    pub dead_letter_rejects: u64,
    pub requeued: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    pub rejected: u64,
    /// Sessions that ended without a stop (connection or channel lost), each followed by
    /// a reconnection.
    pub reconnects: u64,
    /// Outbox rows published and confirmed by the server (then deleted), with
    /// `[rabbitmq.outbox]`.
    pub outbox_relayed: u64,
    /// Outbox publications the server did not take (nacked or unroutable; the rows stay).
    pub outbox_refused: u64,
}

impl RabbitMqSummary {
    fn add(&mut self, s: &RabbitMqStats) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.received += get(&s.received);
        self.redelivered += get(&s.redelivered);
        self.acked += get(&s.acked);
        self.ack_frames += get(&s.ack_frames);
        self.dead_letter_rejects += get(&s.dead_letter_rejects);
        self.requeued += get(&s.requeued);
        let o = &s.outcomes;
        self.processed += get(&o.processed);
        self.duplicate += get(&o.duplicate);
        self.quarantined += get(&o.quarantined);
        self.dead_lettered += get(&o.dead_lettered);
        self.rejected += get(&o.rejected);
    }
}

/// The TLS settings of the section (reads the PEM files; no connection).
fn tls_config(r: &RabbitMqConfig) -> Result<lapin::tcp::OwnedTLSConfig, RabbitMqError> {
    let read = |field: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            RabbitMqError::Config(format!(
                "rabbitmq.{field}: cannot read {}: {e}",
                path.display()
            ))
        })
    };
    let cert_chain = match &r.tls_ca_file {
        Some(p) => Some(String::from_utf8(read("tls_ca_file", p)?).map_err(|_| {
            RabbitMqError::Config(format!(
                "rabbitmq.tls_ca_file: {} is not a PEM file",
                p.display()
            ))
        })?),
        None => None,
    };
    let identity = match (&r.tls_cert_file, &r.tls_key_file) {
        (Some(cert), Some(key)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
            pem: read("tls_cert_file", cert)?,
            key: read("tls_key_file", key)?,
        }),
        _ => None,
    };
    Ok(lapin::tcp::OwnedTLSConfig {
        identity,
        cert_chain,
    })
}

/// `dedupd config check`: parses the URI and reads the TLS files without connecting.
pub(crate) fn check_options(r: &RabbitMqConfig) -> Result<(), RabbitMqError> {
    r.amqp_uri()
        .map_err(|e| RabbitMqError::Config(e.to_string()))?;
    tls_config(r).map(|_| ())
}

/// Why a connection attempt failed (the source tries again, with backoff).
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    /// `rabbitmq.uri` does not parse.
    #[error(transparent)]
    Uri(#[from] crate::config::ConfigError),
    /// The TLS files cannot be read.
    #[error(transparent)]
    Tls(#[from] RabbitMqError),
    /// lapin could not start its runtime, or the server refused the connection.
    #[error(transparent)]
    Lapin(#[from] lapin::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// One connection attempt, bounded by `connect_timeout`.
async fn connect(r: &RabbitMqConfig) -> Result<Connection, ConnectError> {
    let uri = r.amqp_uri()?;
    let tls = tls_config(r)?;
    let props = ConnectionProperties::default().with_connection_name(r.name.clone().into());
    let runtime = lapin::runtime::default_runtime()?;
    let attempt = Connection::connect_uri_with_config(uri, props, tls, runtime);
    match tokio::time::timeout(r.connect_timeout, attempt).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ConnectError::Timeout(r.connect_timeout)),
    }
}

/// Runs every binding until `shutdown` triggers; then each drains and acknowledges what
/// is durable. A lost connection is reestablished with backoff (the server redelivers
/// what was not acknowledged); a failure of the ledger or of a queue operation stops the
/// source and triggers `shutdown`.
pub fn run(
    ledger: Arc<Ledger>,
    r: &RabbitMqConfig,
    shutdown: &Shutdown,
) -> Result<RabbitMqSummary, RabbitMqError> {
    let stats: Vec<Arc<RabbitMqStats>> = r
        .bindings
        .iter()
        .map(|_| Arc::new(RabbitMqStats::default()))
        .collect();
    run_with(ledger, r, shutdown, &stats)
}

/// [`run`], counting into `stats` (one per binding) as it goes.
pub(crate) fn run_with(
    ledger: Arc<Ledger>,
    r: &RabbitMqConfig,
    shutdown: &Shutdown,
    stats: &[Arc<RabbitMqStats>],
) -> Result<RabbitMqSummary, RabbitMqError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("dedupd-rabbitmq")
        .enable_all()
        .build()
        .map_err(|e| RabbitMqError::Client(format!("cannot start the rabbitmq runtime: {e}")))?;
    let outcomes: Vec<consumer::Outcomes> = r
        .bindings
        .iter()
        .map(|b| consumer::Outcomes::new(&b.subscriber))
        .collect();
    let mut reconnects = 0;
    let relay = crate::source::relay::RelayStats::default();
    let result = rt.block_on(run_sessions(
        ledger,
        r,
        shutdown,
        (stats, &outcomes, &relay),
        &mut reconnects,
    ));
    // lapin's I/O threads end with the runtime.
    rt.shutdown_timeout(Duration::from_secs(1));
    if let Err(e) = &result {
        shutdown.trigger(Cause::Failed(e.to_string()));
    }
    result?;
    let mut summary = RabbitMqSummary {
        reconnects,
        outbox_relayed: relay.relayed.load(Ordering::Relaxed),
        outbox_refused: relay.failed.load(Ordering::Relaxed),
        ..Default::default()
    };
    for s in stats {
        summary.add(s);
    }
    Ok(summary)
}

/// How a session ended.
pub(crate) enum Ended {
    /// `shutdown` triggered; the bindings drained.
    Stopped,
    /// The connection or a channel was lost; the server requeues what was not acknowledged.
    Lost(String),
}

/// Sleeps `d` unless `shutdown` triggers first (`false` then).
async fn pause(d: Duration, shutdown: &Shutdown) -> bool {
    tokio::select! {
        () = shutdown.triggered() => false,
        () = tokio::time::sleep(d) => true,
    }
}

async fn run_sessions(
    ledger: Arc<Ledger>,
    r: &RabbitMqConfig,
    shutdown: &Shutdown,
    (stats, outcomes, relay): (
        &[Arc<RabbitMqStats>],
        &[consumer::Outcomes],
        &crate::source::relay::RelayStats,
    ),
    reconnects: &mut u64,
) -> Result<(), RabbitMqError> {
    // The HTTP pull of the outbox answers 409 while the relay owns it.
    let _relaying = r.outbox.enabled.then(|| ledger.attach_outbox_relay());
    // Why the source cannot take messages now; `None` while a session runs.
    let down: Arc<Mutex<Option<String>>> =
        Arc::new(Mutex::new(Some("connecting to the RabbitMQ server".into())));
    let probe = down.clone();
    let _ready = crate::source::readiness::register(
        "rabbitmq",
        Arc::new(move || probe.lock().unwrap_or_else(|p| p.into_inner()).clone()),
    );
    let set_down = |reason: Option<String>| {
        *down.lock().unwrap_or_else(|p| p.into_inner()) = reason;
    };
    let first_delay = Duration::from_millis(100);
    let mut delay = first_delay;
    let mut session = 0;
    loop {
        if shutdown.is_triggered() {
            return Ok(());
        }
        let conn = tokio::select! {
            () = shutdown.triggered() => return Ok(()),
            c = connect(r) => c,
        };
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(uri = %redacted(&r.uri), "cannot connect to RabbitMQ (retrying in {delay:?}): {e}");
                set_down(Some(format!(
                    "cannot connect to the RabbitMQ server ({e}); messages wait in their queues"
                )));
                if !pause(delay, shutdown).await {
                    return Ok(());
                }
                delay = (delay * 2).min(r.reconnect_delay_max);
                continue;
            }
        };
        tracing::info!(uri = %redacted(&r.uri), "rabbitmq connected");
        set_down(None);
        delay = first_delay;
        session += 1;
        let bindings = consumer::run_session(&conn, session, &ledger, r, shutdown, stats, outcomes);
        let ended = if r.outbox.enabled {
            with_relay(&conn, &ledger, r, relay, bindings).await
        } else {
            bindings.await
        };
        match ended {
            Ok(Ended::Stopped) => {
                at_stop(
                    "the connection's close",
                    "",
                    conn.close(200, "dedupd stopped".into()),
                )
                .await;
                return Ok(());
            }
            Ok(Ended::Lost(reason)) => {
                set_down(Some(format!(
                    "not connected to the RabbitMQ server ({reason}); messages wait in their queues until it reconnects"
                )));
                *reconnects += 1;
                metrics::counter!(metric::RABBITMQ_RECONNECTS_TOTAL).increment(1);
                tracing::warn!("rabbitmq session lost ({reason}); unacknowledged messages are requeued by the server and delivered again; reconnecting");
                // Closing hands back every other channel's messages now (not at a timeout).
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(200, "dedupd reconnecting".into()),
                )
                .await;
                if !pause(delay, shutdown).await {
                    return Ok(());
                }
            }
            Err(e) => {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(200, "dedupd failed".into()),
                )
                .await;
                return Err(e);
            }
        }
    }
}

/// Runs the session's bindings with the outbox relay beside them; at a stop the relay
/// goes on after the bindings drained (their last commits may have emitted), until the
/// outbox is empty or `drain_timeout` passed.
async fn with_relay(
    conn: &Connection,
    ledger: &Arc<Ledger>,
    r: &RabbitMqConfig,
    stats: &crate::source::relay::RelayStats,
    bindings: impl std::future::Future<Output = Result<Ended, RabbitMqError>>,
) -> Result<Ended, RabbitMqError> {
    let (finish_tx, finish_rx) = tokio::sync::watch::channel(None);
    let relay = outbox::relay(conn, ledger, &r.outbox, stats, finish_rx);
    tokio::pin!(relay, bindings);
    let ended = tokio::select! {
        ended = &mut bindings => ended,
        relayed = &mut relay => {
            // The relay ends early only when the ledger failed.
            relayed?;
            return bindings.await;
        }
    };
    if let Ok(Ended::Stopped) = ended {
        let deadline = tokio::time::Instant::now() + r.drain_timeout;
        finish_tx.send_replace(Some(deadline));
        // The relay checks its deadline between rounds; a round waiting for publisher
        // confirms the server never sends is cut here (its rows stay in the outbox).
        match tokio::time::timeout_at(deadline + STOP_REPLY, &mut relay).await {
            Ok(relayed) => relayed?,
            Err(_) => tracing::warn!(
                "rabbitmq outbox relay: no publisher confirms within rabbitmq.drain_timeout; stopping with rows not yet published (relayed by the next run)"
            ),
        }
    }
    ended
}

/// The URI without its password, for logs.
fn redacted(uri: &str) -> String {
    match (uri.find("://"), uri.rfind('@')) {
        (Some(s), Some(at)) if at > s => match uri[s + 3..at].find(':') {
            Some(colon) => format!("{}:***{}", &uri[..s + 3 + colon], &uri[at..]),
            None => uri.to_string(),
        },
        _ => uri.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logged_uris_hide_the_password() {
        assert_eq!(
            redacted("amqp://u:secret@h:5672/v"),
            "amqp://u:***@h:5672/v"
        );
        assert_eq!(redacted("amqp://h:5672/v"), "amqp://h:5672/v");
        assert_eq!(redacted("amqp://u@h/v"), "amqp://u@h/v");
    }
}
