//! # dedupd
//!
//! An engine that makes at-least-once delivery safe. For every message it derives a stable
//! idempotency key, claims `(subscriber, key)` in an embedded transactional store (redb),
//! and acknowledges the source only after the claim is durable. A redelivered message
//! becomes a `duplicate`; the same key with another payload is `quarantined`.
//!
//! ## Guarantees
//!
//! - **G1 Ack after durable commit.** No outcome is released (stdin line printed, offset
//!   stored, HTTP 2xx sent) before the transaction holding its claim is fsync'd.
//! - **G2 Effectively-once local effects.** Claims (and, with handlers, their state writes)
//!   happen once per `(subscriber, id)` inside the retention window, whatever the
//!   redelivery, crash or restart pattern.
//! - **G3 No false "duplicate".** Filters only say "no" or "maybe"; only the store says
//!   "duplicate". Filters are loaded before any message is accepted.
//! - **G4 Same id, different payload is not a duplicate.** Claims keep a payload
//!   fingerprint; a mismatch is quarantined (kept, counted, visible), never dropped.
//! - **G5 Subscriber isolation.** Claims are scoped by subscriber.
//! - **G6 Failure rolls back.** A handler trap, timeout, memory blow-up or returned error
//!   leaves no claim and no state; the message is retried with backoff, then dead-lettered.
//! - **G7 Fail-stop on storage errors.** A failed commit (or a panic on a shard's writer
//!   thread) stops all acknowledgement and the process exits non-zero; a shard file missing
//!   next to the manifest is refused at open.
//!
//! ## Architecture
//!
//! ```text
//! source/    stdin JSON lines | HTTP ingest | Kafka records | NATS JetStream | RabbitMQ
//!            | generator
//!   -> source::delivery::route (one step for every source and for replay):
//!      decode, idempotency key (xxh3-128), payload fingerprint, entity
//!   -> Ledger::place: shard by key (no handler), by subscriber (handler), or by entity
//!      (handler + partition key; state scoped to the entity)
//!   -> shard writer thread (one redb file each)
//!        batch = everything queued since the last commit (group commit)
//!        decide: active index -> sealing index -> sealed filters + tables
//!                (-> the other shards, when the subscriber's claims may be there)
//!        new -> handler (WASM component; its writes buffered, kept only on success)
//!        append claims as one log row + handler effects, a slice of sealing/merging,
//!        commit (Immediate)
//!   -> outcomes -> Sequencer releases them in source order
//!   -> ack: stdin line printed | HTTP response | Kafka offset stored | NATS Ack/Term
//!      | RabbitMQ basic.ack/basic.reject
//!      | bench acker
//! ```
//!
//! [`pipeline::run`] composes a process from these parts (pipe mode, the HTTP API with or
//! without stdin, Kafka, NATS, MQTT or RabbitMQ with or without the API), stopped by one
//! [`pipeline::Shutdown`] that signals, a ledger failure and a source failure all trigger.
//!
//! Modules, in the order of the flow: [`source`] (stdin, Kafka — the only rdkafka user —,
//! NATS JetStream — the only async-nats user —, MQTT — the only rumqttc user —, RabbitMQ —
//! the only lapin user —, the generator, and the shared routing step), [`envelope`] (keys
//! and fingerprints),
//! [`config`] (validated settings), [`ledger`] (the only redb user), [`effects`] (the seam
//! between the ledger and handlers), [`handler`] (the only wasmtime user), [`harness`]
//! (`dedupd handler test`: a component over test messages on a temporary ledger), [`pipeline`]
//! (ordering, handler installation, run modes, shutdown), [`admin`] (the HTTP API, ingest
//! and dashboard; the only axum user), [`inspect`] (offline looks into a data directory),
//! [`telemetry`] (latency histograms, memory), [`bench`](mod@bench) and [`demo`] (the
//! CLI's measuring commands). The `dedupd` binary (`src/bin/dedupd/`) parses arguments and
//! prints.

//! ## Example
//!
//! ```
//! use std::sync::Arc;
//! use dedupd::{clock::SystemClock, config::Config, ledger::{Ledger, Outcome}};
//! use dedupd::source::delivery::{route, Delivery, Keying, Payload, Target};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let ledger = Ledger::open(dir.path(), &Config::default(), Arc::new(SystemClock)).unwrap();
//! let (ack, outcomes) = crossbeam_channel::unbounded();
//! for seq in 0..2 {
//!     // What a source received: a message for subscriber `billing`, with an id.
//!     let payload = Payload::Json(serde_json::json!({"order": 1, "total": 30}));
//!     let mut delivery = Delivery::new(Target::Name("billing".into()), payload);
//!     delivery.id = Some("order-1".into());
//!     // The step every source shares: key, fingerprint, placement.
//!     let mut routed = route(&ledger, delivery, Keying::Derive, ack.clone()).unwrap();
//!     routed.job.seq = seq;
//!     ledger.submit(routed.shard, vec![routed.job]).unwrap();
//!     // Released once the claim is durable (G1); the redelivery is a duplicate.
//!     let done = outcomes.recv().unwrap();
//!     let want = if seq == 0 { Outcome::Processed } else { Outcome::Duplicate };
//!     assert_eq!(done[0].outcome, want);
//! }
//! ledger.close().unwrap();
//! ```

// What the library offers is what is `pub` here; everything else is `pub(crate)`.
#![warn(unreachable_pub)]

pub mod admin;
pub mod backup;
pub mod bench;
pub mod clock;
pub mod config;
pub mod demo;
pub mod effects;
pub mod envelope;
#[cfg(test)]
pub mod fuzzing;
pub mod handler;
pub mod harness;
pub mod inspect;
pub mod ledger;
pub mod pipeline;
pub mod scaffold;
pub mod source;
pub mod telemetry;

/// The commit this build comes from (`git rev-parse --short=12 HEAD` when it was built,
/// `unknown` outside a git checkout).
pub(crate) const REVISION: &str = env!("DEDUPD_REVISION");

/// What `dedupd --version` and `dedupd version` print after the name: the version, the
/// commit, and the formats this build reads and writes.
pub fn version_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        format!(
            "{} (commit {REVISION})\ndata format {} (older data directories are upgraded on open), \
             backup format {}, changelog value format {}",
            env!("CARGO_PKG_VERSION"),
            ledger::FORMAT_VERSION,
            backup::BACKUP_FORMAT,
            source::kafka::changelog::EPOCH_FORMAT,
        )
    })
}
