//! The run modes of the `dedupd` binary, composed from the sources, the ledger and the
//! HTTP API: which parts run, on which threads, and how they stop together (one
//! [`Shutdown`] per run).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::serve::HttpServer;
use super::shutdown::notify_service_manager;
use super::UploadError;
use super::{install_handlers, Cause, Shutdown};
use crate::admin::HttpConfig;
use crate::clock::SystemClock;
use crate::config::{Config, ConfigError};
use crate::handler::HandlerError;
use crate::ledger::{Ledger, LedgerError};
use crate::source::kafka::{self, KafkaConfig, KafkaError, KafkaSummary};
use crate::source::mqtt::{self, MqttConfig, MqttError, MqttSummary};
use crate::source::nats::{self, NatsConfig, NatsError, NatsSummary};
use crate::source::rabbitmq::{self, RabbitMqConfig, RabbitMqError, RabbitMqSummary};
use crate::source::stdin::{run_pipe, PipeError, PipeSummary};

/// What to run over the data directory.
#[derive(Debug, Clone)]
pub enum Mode {
    /// JSON lines on stdin, outcomes on stdout, until stdin ends.
    Pipe,
    /// The HTTP API (and, with `stdin`, pipe mode on stdin beside it) until SIGINT/SIGTERM.
    Serve { http: HttpConfig, stdin: bool },
    /// The Kafka source (and the HTTP API when given) until SIGINT/SIGTERM.
    Kafka {
        kafka: Box<KafkaConfig>,
        http: Option<HttpConfig>,
    },
    /// The NATS JetStream source (and the HTTP API when given) until SIGINT/SIGTERM.
    Nats {
        nats: Box<NatsConfig>,
        http: Option<HttpConfig>,
    },
    /// The MQTT source (and the HTTP API when given) until SIGINT/SIGTERM.
    Mqtt {
        mqtt: Box<MqttConfig>,
        http: Option<HttpConfig>,
    },
    /// The RabbitMQ source (and the HTTP API when given) until SIGINT/SIGTERM.
    RabbitMq {
        rabbitmq: Box<RabbitMqConfig>,
        http: Option<HttpConfig>,
    },
}

impl Mode {
    /// The mode a config describes: Kafka when it has a `[kafka]` section, NATS when it
    /// has `[nats]`, MQTT when it has `[mqtt]`, RabbitMQ when it has `[rabbitmq]`
    /// (validation refuses two of them), else the HTTP API with stdin when it has
    /// `[http]`, else pipe mode.
    pub fn of(config: &Config) -> Mode {
        if let (None, Some(nats)) = (&config.kafka, &config.nats) {
            return Mode::Nats {
                nats: Box::new(nats.clone()),
                http: config.http.clone(),
            };
        }
        if let (None, None, Some(mqtt)) = (&config.kafka, &config.nats, &config.mqtt) {
            return Mode::Mqtt {
                mqtt: Box::new(mqtt.clone()),
                http: config.http.clone(),
            };
        }
        if let (None, None, Some(rabbitmq)) = (&config.kafka, &config.nats, &config.rabbitmq) {
            return Mode::RabbitMq {
                rabbitmq: Box::new(rabbitmq.clone()),
                http: config.http.clone(),
            };
        }
        match (config.kafka.clone(), config.http.clone()) {
            (None, None) => Mode::Pipe,
            (None, Some(http)) => Mode::Serve { http, stdin: true },
            (Some(kafka), http) => Mode::Kafka {
                kafka: Box::new(kafka),
                http,
            },
        }
    }
}

/// What a finished run did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Summary {
    Pipe(PipeSummary),
    Serve,
    Kafka(KafkaSummary),
    Nats(NatsSummary),
    Mqtt(MqttSummary),
    RabbitMq(RabbitMqSummary),
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Handler(#[from] HandlerError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Upload(#[from] UploadError),
    #[error("cannot listen on {addr} (http.bind): {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Pipe(#[from] PipeError),
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error(transparent)]
    Mqtt(#[from] MqttError),
    #[error(transparent)]
    RabbitMq(#[from] RabbitMqError),
    #[error("HTTP server task failed: {0}")]
    Server(String),
    /// The ledger or a source failed while running (G7).
    #[error("{0}")]
    Stopped(String),
}

/// Opens the ledger in `dir`, installs the configured handlers and runs `mode` until it
/// ends. Every acknowledged outcome was durable before it was acknowledged (G1); the
/// ledger is closed cleanly when no part of the run still holds it.
///
/// Pipe mode ends the process (exit 1) when the ledger fails while stdin is still open:
/// nothing more will be acknowledged (G7), and waiting for stdin to close would hide it.
pub fn run(config: &Config, dir: &Path, mode: Mode) -> Result<Summary, RunError> {
    if let Mode::Kafka { .. } | Mode::Nats { .. } | Mode::Mqtt { .. } | Mode::RabbitMq { .. } =
        &mode
    {
        // Sources that record through the metrics facade before the server starts are kept.
        crate::admin::install_metrics();
    }
    tracing::info!(data_dir = %dir.display(), version = env!("CARGO_PKG_VERSION"),
        format = crate::ledger::FORMAT_VERSION, "starting");
    let started = std::time::Instant::now();
    let ledger = Arc::new(Ledger::open(dir, config, Arc::new(SystemClock))?);
    install_handlers(&ledger, config)?;
    tracing::info!(
        shards = ledger.shard_count(),
        subscribers = config.subscribers.len(),
        handlers = ledger
            .subscribers()
            .iter()
            .filter(|s| s.has_handler())
            .count(),
        open_ms = started.elapsed().as_millis() as u64,
        "ready: claims, filters and handlers loaded"
    );
    let shutdown = Shutdown::new();
    shutdown.on_ledger_failure(&ledger);
    let metrics = match &config.metrics {
        Some(m) => Some(HttpServer::start_metrics(&ledger, m.bind, Shutdown::new())?),
        None => None,
    };
    let result = match mode {
        Mode::Pipe => pipe(&ledger, config, &shutdown).map(Summary::Pipe),
        Mode::Serve { http, stdin } => serve(&ledger, config, http, stdin, &shutdown),
        Mode::Kafka { kafka, http } => {
            run_broker(&ledger, config, &*kafka, http, &shutdown).map(Summary::Kafka)
        }
        Mode::Nats { nats, http } => {
            run_broker(&ledger, config, &*nats, http, &shutdown).map(Summary::Nats)
        }
        Mode::Mqtt { mqtt, http } => {
            run_broker(&ledger, config, &*mqtt, http, &shutdown).map(Summary::Mqtt)
        }
        Mode::RabbitMq { rabbitmq, http } => {
            run_broker(&ledger, config, &*rabbitmq, http, &shutdown).map(Summary::RabbitMq)
        }
    };
    if let Some(server) = metrics {
        server.stop()?;
    }
    // A stdin thread in serve mode may still hold the ledger (blocked reading input):
    // the shards stop and close their files all the same, so a clean exit leaves a clean
    // directory; what that thread submits afterwards is never acknowledged (G1).
    let closed = match Arc::try_unwrap(ledger) {
        Ok(l) => l.close(),
        Err(shared) => shared.stop(),
    };
    let summary = result?;
    closed?;
    Ok(summary)
}

fn pipe(ledger: &Ledger, config: &Config, shutdown: &Shutdown) -> Result<PipeSummary, RunError> {
    let watcher = shutdown.clone();
    std::thread::Builder::new()
        .name("dedupd-failstop".into())
        .spawn(move || {
            if let Cause::Failed(reason) = watcher.wait() {
                // Give the printer a moment to flush the lines that were durable.
                std::thread::sleep(Duration::from_millis(200));
                eprintln!("dedupd: {reason}");
                std::process::exit(1);
            }
        })?;
    ready();
    let summary = run_pipe(ledger, config, std::io::stdin().lock(), std::io::stdout());
    if summary.is_ok() {
        shutdown.trigger(Cause::Requested);
    }
    let summary = summary?;
    tracing::info!(
        lines = summary.lines,
        processed = summary.processed,
        duplicate = summary.duplicate,
        quarantined = summary.quarantined,
        dead_lettered = summary.dead_lettered,
        rejected = summary.rejected,
        "input ended; every outcome is durable and printed"
    );
    Ok(summary)
}

fn serve(
    ledger: &Arc<Ledger>,
    config: &Config,
    http: HttpConfig,
    stdin: bool,
    shutdown: &Shutdown,
) -> Result<Summary, RunError> {
    shutdown.on_signals()?;
    let server = HttpServer::start(ledger, config, http, shutdown.clone())?;
    ready();
    if stdin {
        let (config, ledger) = (config.clone(), ledger.clone());
        // Pipe mode on its own thread, so a signal ends the process even while stdin is open.
        std::thread::Builder::new()
            .name("dedupd-stdin".into())
            .spawn(move || {
                let r = run_pipe(&ledger, &config, std::io::stdin().lock(), std::io::stdout());
                if let Err(e) = r {
                    eprintln!("dedupd: stdin source stopped: {e}");
                }
            })?;
    }
    server.join()?;
    tracing::info!(cause = ?shutdown.cause(), "stopped; every answered request was durable first");
    match shutdown.cause() {
        Some(Cause::Failed(reason)) => Err(RunError::Stopped(reason)),
        _ => Ok(Summary::Serve),
    }
}

/// A broker source as `dedupd run` drives it: what its stop may take and leaves behind,
/// how it runs, and the line that logs its summary (as fields, one per counter).
trait BrokerSource {
    type Summary;
    /// The broker's name in messages (`NATS`).
    const NAME: &'static str;
    /// What a stop cut short leaves for the broker to do.
    const LEFT: &'static str;
    fn drain_timeout(&self) -> Duration;
    /// Runs the source until `shutdown` triggers and it has drained.
    fn run(&self, ledger: Arc<Ledger>, shutdown: &Shutdown) -> Result<Self::Summary, RunError>;
    /// Logs what a finished run did.
    fn log_stopped(summary: &Self::Summary);
}

/// On a stop the API keeps answering while the consumers drain and store their offsets
/// and the outbox is relayed; then it stops too.
impl BrokerSource for KafkaConfig {
    type Summary = KafkaSummary;
    const NAME: &'static str = "Kafka";
    const LEFT: &'static str = "uncommitted offsets will be redelivered as duplicates";
    fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }
    fn run(&self, ledger: Arc<Ledger>, shutdown: &Shutdown) -> Result<KafkaSummary, RunError> {
        Ok(kafka::run(ledger, self, shutdown)?)
    }
    fn log_stopped(s: &KafkaSummary) {
        tracing::info!(
            received = s.received,
            released = s.released,
            processed = s.processed,
            duplicate = s.duplicate,
            quarantined = s.quarantined,
            dead_lettered = s.dead_lettered,
            rejected = s.rejected,
            revoked_partitions = s.revoked_partitions,
            revoke_commit_failures = s.revoke_commit_failures,
            shared_group_rebalances = s.shared_group_rebalances,
            restored_changes = s.restored_changes,
            restored_emitted = s.restored_emitted,
            restored_records = s.restored_records,
            changelog_tombstones = s.changelog_tombstones,
            changelog_snapshots = s.changelog_snapshots,
            outbox_relayed = s.outbox_relayed,
            "stopped; every stored offset covers durable outcomes"
        );
    }
}

/// Like Kafka: the API keeps answering while the bindings drain and acknowledge what is
/// durable (unacknowledged messages are delivered again and answered `duplicate`).
impl BrokerSource for NatsConfig {
    type Summary = NatsSummary;
    const NAME: &'static str = "NATS";
    const LEFT: &'static str = "unacknowledged messages will be redelivered as duplicates";
    fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }
    fn run(&self, ledger: Arc<Ledger>, shutdown: &Shutdown) -> Result<NatsSummary, RunError> {
        Ok(nats::run(ledger, self, shutdown)?)
    }
    fn log_stopped(s: &NatsSummary) {
        tracing::info!(
            received = s.received,
            redelivered = s.redelivered,
            acked = s.acked,
            terminated = s.terminated,
            naked = s.naked,
            processed = s.processed,
            duplicate = s.duplicate,
            quarantined = s.quarantined,
            dead_lettered = s.dead_lettered,
            rejected = s.rejected,
            "stopped; every acknowledgement covers a durable outcome"
        );
    }
}

/// Like NATS: what was not acknowledged stays in the broker's session and is delivered
/// again at the next start (a `duplicate` once durable).
impl BrokerSource for MqttConfig {
    type Summary = MqttSummary;
    const NAME: &'static str = "MQTT";
    const LEFT: &'static str =
        "unacknowledged messages stay in the session and come again as duplicates";
    fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }
    fn run(&self, ledger: Arc<Ledger>, shutdown: &Shutdown) -> Result<MqttSummary, RunError> {
        Ok(mqtt::run(ledger, self, shutdown)?)
    }
    fn log_stopped(s: &MqttSummary) {
        tracing::info!(
            received = s.received,
            redelivered = s.redelivered,
            acked = s.acked,
            unacked_lost = s.unacked_lost,
            processed = s.processed,
            duplicate = s.duplicate,
            quarantined = s.quarantined,
            dead_lettered = s.dead_lettered,
            rejected = s.rejected,
            connections = s.connections,
            "stopped; every acknowledgement covers a durable outcome"
        );
    }
}

/// Like NATS: the API keeps answering while the bindings drain and acknowledge what is
/// durable (unacknowledged messages are requeued and answered `duplicate`).
impl BrokerSource for RabbitMqConfig {
    type Summary = RabbitMqSummary;
    const NAME: &'static str = "RabbitMQ";
    const LEFT: &'static str =
        "unacknowledged messages are requeued by the server and redelivered as duplicates";
    fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }
    fn run(&self, ledger: Arc<Ledger>, shutdown: &Shutdown) -> Result<RabbitMqSummary, RunError> {
        Ok(rabbitmq::run(ledger, self, shutdown)?)
    }
    fn log_stopped(s: &RabbitMqSummary) {
        tracing::info!(
            received = s.received,
            redelivered = s.redelivered,
            acked = s.acked,
            dead_letter_rejects = s.dead_letter_rejects,
            requeued = s.requeued,
            processed = s.processed,
            duplicate = s.duplicate,
            quarantined = s.quarantined,
            dead_lettered = s.dead_lettered,
            rejected = s.rejected,
            reconnects = s.reconnects,
            outbox_relayed = s.outbox_relayed,
            outbox_refused = s.outbox_refused,
            "stopped; every acknowledgement covers a durable outcome"
        );
    }
}

/// What every broker mode shares around its source: signals, the stop watchdog, the
/// optional API (answering while the source drains), the readiness notice, the summary
/// logged at the end.
///
/// A client library can block its close for long when no broker answers; durable outcomes
/// are safe without it (what was not acknowledged is only delivered again), so a stop that
/// takes far longer than the drain allows ends the process.
fn run_broker<B: BrokerSource>(
    ledger: &Arc<Ledger>,
    config: &Config,
    source: &B,
    http: Option<HttpConfig>,
    shutdown: &Shutdown,
) -> Result<B::Summary, RunError> {
    shutdown.on_signals()?;
    let limit = source.drain_timeout() * 2 + Duration::from_secs(10);
    let watchdog = shutdown.clone();
    std::thread::Builder::new()
        .name("dedupd-stop-watchdog".into())
        .spawn(move || {
            watchdog.wait();
            std::thread::sleep(limit);
            eprintln!(
                "dedupd: shutdown did not finish within {limit:?} ({} unreachable?); exiting; {}",
                B::NAME,
                B::LEFT
            );
            std::process::exit(1);
        })?;
    let server = match http {
        Some(http) => Some(HttpServer::start(ledger, config, http, Shutdown::new())?),
        None => None,
    };
    ready();
    let result = source.run(ledger.clone(), shutdown);
    if let Some(server) = server {
        server.stop()?;
    }
    let summary = result?;
    B::log_stopped(&summary);
    Ok(summary)
}

/// The ledger is open, its handlers installed and the listeners bound: tells systemd
/// (`Type=notify`). Whether a source can reach its broker is `/readyz`'s business.
fn ready() {
    notify_service_manager(
        &[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status("ready"),
        ],
        "ready",
    );
}
