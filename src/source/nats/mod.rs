//! The NATS JetStream source: the only module that imports async-nats.
//!
//! - `NatsConfig` (`config.rs`): the `[nats]` section — servers, credentials, TLS and
//!   `[[nats.binding]]`s (stream, durable consumer, subscriber), checked offline by
//!   `dedupd config check`.
//! - `consumer.rs`: one durable pull consumer per binding — every message keyed by the
//!   shared step ([`crate::source::delivery::route`]), acknowledged (`Ack`, or `Term`
//!   for dead letters) only after its outcome is durable (G1), the in-flight window
//!   bounded by `max_ack_pending`, `Nak` with delay for what a stop gives back.
//! - [`mod@bench`]: `dedupd nats-bench`, the source against a consume-only pull consumer.
//! - [`run`] (here): the connection, a probe for `/readyz` while it is down, one task per
//!   binding, the stop.
//!
//! Keying: a subscriber whose key source is `id` takes the `Nats-Msg-Id` header (the one
//! JetStream's own duplicate window reads) as its idempotency key; other key sources
//! read headers and payload as for every source. The subject is the envelope `key` (a
//! `partition_key = { source = "envelope_key" }` places handler state by subject).
//!
//! Several dedupd instances may bind the same durable consumer: the server hands each
//! message to one of them at a time. Instances do not share claims, so a message
//! redelivered to another instance (after `AckWait`, or a crash) is processed there again
//! unless the instances share a ledger; run one instance per durable consumer when effects
//! must happen once (docs/nats.md).

pub mod bench;
mod config;
mod consumer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions};

pub(crate) use config::{BindingConfig, NatsConfig};

use crate::ledger::Ledger;
use crate::pipeline::{Cause, Shutdown};
use crate::source::settle::OutcomeStats;

/// Why the NATS source stopped.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The server could not be reached or refused a request; check `nats.servers`, the
    /// credentials and the stream and consumer names.
    #[error("nats client error: {0}")]
    Client(String),
    /// The ledger failed (G7): nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {0}")]
    Ledger(String),
    /// The section, or a consumer it names, is unusable.
    #[error("{0}")]
    Config(String),
}

/// Live counters of one binding.
#[derive(Debug, Default)]
pub(crate) struct NatsStats {
    /// Messages received from the server (redeliveries included).
    pub(crate) received: AtomicU64,
    /// Messages received with `delivered > 1`: the server delivered them before.
    pub(crate) redelivered: AtomicU64,
    /// `Ack`s sent (outcome durable: processed, duplicate or quarantined).
    pub(crate) acked: AtomicU64,
    /// `Term`s sent (dead-lettered or rejected, kept in the ledger's dead letters).
    pub(crate) terminated: AtomicU64,
    /// `Nak`s sent (given back at stop, not durable).
    pub(crate) naked: AtomicU64,
    /// Durable outcomes by kind.
    pub(crate) outcomes: OutcomeStats,
}

/// What a stopped NATS source did, all bindings together.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct NatsSummary {
    pub received: u64,
    pub redelivered: u64,
    pub acked: u64,
    pub terminated: u64,
    pub naked: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    pub rejected: u64,
}

impl NatsSummary {
    fn add(&mut self, s: &NatsStats) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.received += get(&s.received);
        self.redelivered += get(&s.redelivered);
        self.acked += get(&s.acked);
        self.terminated += get(&s.terminated);
        self.naked += get(&s.naked);
        let o = &s.outcomes;
        self.processed += get(&o.processed);
        self.duplicate += get(&o.duplicate);
        self.quarantined += get(&o.quarantined);
        self.dead_lettered += get(&o.dead_lettered);
        self.rejected += get(&o.rejected);
    }
}

/// The client options of the section: name, credentials, TLS. Reads the credentials
/// file (no connection).
pub(crate) async fn connect_options(nats: &NatsConfig) -> Result<ConnectOptions, NatsError> {
    let mut o = match &nats.credentials_file {
        Some(path) => ConnectOptions::with_credentials_file(path)
            .await
            .map_err(|e| {
                NatsError::Config(format!(
                    "nats.credentials_file: cannot read {}: {e}",
                    path.display()
                ))
            })?,
        None => ConnectOptions::new(),
    };
    o = o
        .name(&nats.name)
        .connection_timeout(nats.connect_timeout)
        .require_tls(nats.require_tls)
        .event_callback(|event| async move {
            tracing::warn!("nats connection: {event}");
        });
    if let Some(token) = &nats.token {
        o = o.token(token.clone());
    }
    if let (Some(user), Some(password)) = (&nats.user, &nats.password) {
        o = o.user_and_password(user.clone(), password.clone());
    }
    if let Some(ca) = &nats.tls_ca_file {
        o = o.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&nats.tls_cert_file, &nats.tls_key_file) {
        o = o.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(o)
}

/// `dedupd config check`: builds the client options (reading the credentials file)
/// without connecting.
pub(crate) fn check_options(nats: &NatsConfig) -> Result<(), NatsError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| NatsError::Client(format!("cannot start a runtime: {e}")))?;
    rt.block_on(connect_options(nats)).map(|_| ())
}

async fn connect(nats: &NatsConfig) -> Result<Client, NatsError> {
    let options = connect_options(nats).await?;
    let addrs: Vec<async_nats::ServerAddr> = nats
        .servers
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()
        .map_err(|e| NatsError::Config(format!("nats.servers: {e}")))?;
    options.connect(addrs).await.map_err(|e| {
        let e = e.to_string();
        let hint = client_certificate_hint(&e, nats.tls_cert_file.is_some());
        NatsError::Client(format!("cannot connect to {:?}: {e}{hint}", nats.servers))
    })
}

/// What to add to a connection error when the server ended the TLS handshake with an
/// alert about the client's certificate while dedupd sent none: a server whose `tls`
/// block has `verify: true` requires one (Go's TLS 1.2 says `BadCertificate`, TLS 1.3
/// `CertificateRequired`), which the error alone does not say.
fn client_certificate_hint(error: &str, sent_certificate: bool) -> &'static str {
    let alert = ["BadCertificate", "CertificateRequired"]
        .iter()
        .any(|a| error.contains(&format!("received fatal alert: {a}")));
    if alert && !sent_certificate {
        " (the server requires a client certificate: set nats.tls_cert_file and nats.tls_key_file)"
    } else {
        ""
    }
}

/// Runs every binding until `shutdown` triggers; then each drains and acknowledges what
/// is durable. The first failure triggers `shutdown`, so the other bindings stop too.
pub fn run(
    ledger: Arc<Ledger>,
    nats: &NatsConfig,
    shutdown: &Shutdown,
) -> Result<NatsSummary, NatsError> {
    let stats: Vec<Arc<NatsStats>> = nats
        .bindings
        .iter()
        .map(|_| Arc::new(NatsStats::default()))
        .collect();
    run_with(ledger, nats, shutdown, &stats)
}

/// [`run`] counting into `stats`, one per binding (`nats-bench` watches them).
pub(crate) fn run_with(
    ledger: Arc<Ledger>,
    nats: &NatsConfig,
    shutdown: &Shutdown,
    stats: &[Arc<NatsStats>],
) -> Result<NatsSummary, NatsError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("dedupd-nats")
        .enable_all()
        .build()
        .map_err(|e| NatsError::Client(format!("cannot start the nats runtime: {e}")))?;
    let result = rt.block_on(run_bindings(ledger, nats, shutdown, stats));
    if let Err(e) = &result {
        shutdown.trigger(Cause::Failed(e.to_string()));
    }
    result?;
    let mut summary = NatsSummary::default();
    for s in stats {
        summary.add(s);
    }
    Ok(summary)
}

/// What `/readyz` says of the connection (`None`: connected).
fn unready(client: Option<&Client>) -> Option<String> {
    match client.map(Client::connection_state) {
        Some(State::Connected) => None,
        None => Some("connecting to the NATS server".into()),
        Some(state) => Some(format!(
            "not connected to the NATS server ({state:?}); messages wait in JetStream until it reconnects"
        )),
    }
}

async fn run_bindings(
    ledger: Arc<Ledger>,
    nats: &NatsConfig,
    shutdown: &Shutdown,
    stats: &[Arc<NatsStats>],
) -> Result<(), NatsError> {
    // Not ready from before the first connection until the source stops.
    let connected: Arc<std::sync::OnceLock<Client>> = Arc::default();
    let probe = connected.clone();
    let _ready = crate::source::readiness::register("nats", Arc::new(move || unready(probe.get())));
    let client = connect(nats).await?;
    tracing::info!(servers = ?nats.servers, "nats connected");
    let _ = connected.set(client.clone());
    let js = async_nats::jetstream::new(client);
    let tasks: Vec<_> = nats
        .bindings
        .iter()
        .zip(stats)
        .map(|(b, st)| {
            let (js, ledger, b, st, stop) = (
                js.clone(),
                ledger.clone(),
                b.clone(),
                st.clone(),
                shutdown.clone(),
            );
            let failed = shutdown.clone();
            let timeout = nats.drain_timeout;
            tokio::spawn(async move {
                let r = consumer::run_binding(js, ledger, b, timeout, st, stop).await;
                if let Err(e) = &r {
                    failed.trigger(Cause::Failed(e.to_string()));
                }
                r
            })
        })
        .collect();
    let mut first_err = None;
    for t in tasks {
        let r = t
            .await
            .unwrap_or_else(|e| Err(NatsError::Client(format!("binding task failed: {e}"))));
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::client_certificate_hint;

    #[test]
    fn a_certificate_alert_without_a_client_certificate_says_the_server_requires_one() {
        for alert in ["BadCertificate", "CertificateRequired"] {
            let e = format!("IO error: received fatal alert: {alert}");
            assert!(
                client_certificate_hint(&e, false).contains("requires a client certificate"),
                "{e}"
            );
            // A certificate was sent: the alert is about that one, not a missing one.
            assert_eq!(client_certificate_hint(&e, true), "");
        }
        let other = "IO error: invalid peer certificate: UnknownIssuer";
        assert_eq!(client_certificate_hint(other, false), "");
    }
}
