//! Configuration: serde types that reject nonsense at load time.
//!
//! Every field has a default, so an empty file (or no file) is a valid configuration for the
//! embedded pipe mode. Durations take units (`"250ms"`, `"24h"`, `"7d"`).

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Keys longer than this are rejected unless a subscriber says otherwise.
pub const DEFAULT_MAX_KEY_BYTES: usize = 1024;

/// Errors found while loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: `{field}` {problem}")]
    Invalid { field: String, problem: String },
}

mod env;
#[cfg(test)]
mod fuzz;

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where shard files live. The CLI flag `--data-dir` wins over this.
    pub data_dir: Option<PathBuf>,
    /// Storage engine settings.
    pub ledger: LedgerConfig,
    /// Settings for subscribers that are not listed in `subscriber`.
    pub defaults: SubscriberSettings,
    /// Accept messages for subscribers that are not listed, using `defaults`.
    pub allow_unknown_subscribers: bool,
    /// Subscriber used by pipe mode when an input line names none.
    pub default_subscriber: String,
    /// Explicitly configured subscribers.
    #[serde(rename = "subscriber")]
    pub subscribers: Vec<SubscriberConfig>,
    /// The admin and ingest HTTP server (`dedupd serve`; `dedupd run` starts it when set).
    #[serde(default)]
    pub http: Option<crate::admin::HttpConfig>,
    /// The Kafka source (`dedupd run` consumes it when present).
    #[serde(default)]
    pub kafka: Option<crate::source::kafka::KafkaConfig>,
    /// A listener for `/metrics`, `/healthz` and `/readyz` only (`dedupd run`), for
    /// deployments without the admin API or with it on another address.
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
    /// Limits of pipe mode (stdin lines in, outcome lines out).
    pub pipe: PipeConfig,
}

/// `[metrics]`: where the metrics-only listener binds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// For example `127.0.0.1:9464`. It serves subscriber names and counts, no payloads
    /// and no writes.
    pub bind: std::net::SocketAddr,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: None,
            ledger: LedgerConfig::default(),
            defaults: SubscriberSettings::default(),
            allow_unknown_subscribers: true,
            default_subscriber: "default".to_string(),
            subscribers: Vec::new(),
            http: None,
            kafka: None,
            metrics: None,
            pipe: PipeConfig::default(),
        }
    }
}

/// Storage engine settings. See `docs/design.md` for how they interact.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Number of shards (one redb file and one writer thread each). Default: number of cores.
    /// Fixed when a data directory is created; a different value later is an error.
    pub shards: Option<NonZeroUsize>,
    /// Most messages in one commit. A batch grows while the previous commit's fsync runs.
    /// 1 to 1,048,576.
    pub max_batch: NonZeroUsize,
    /// How long a writer waits for more messages before committing a batch that is not full.
    #[serde(with = "humantime_serde")]
    pub max_linger: Duration,
    /// Claims in an active generation before it is sealed into a sorted table. A busy
    /// subscriber's in-memory index is sized for this many plus one batch (a generation
    /// seals after the batch that filled it): a hash table of 49-byte slots, a power of two
    /// of them at most 7/8 full. The default, 440,000, with the default `max_batch` fits
    /// 2^19 slots (24.5 MiB per shard); 524,288 needed 2^20. 16 to 16,777,216.
    pub generation_max_claims: NonZeroUsize,
    /// Age at which a non-empty active generation is sealed even when not full.
    #[serde(with = "humantime_serde")]
    pub generation_max_age: Duration,
    /// Sealed generations smaller than this are merged with a neighbour.
    /// 16 to 1,073,741,824.
    pub merge_max_claims: NonZeroUsize,
    /// Sealed generations per subscriber and shard above which merging starts (a lookup
    /// may probe each of them). 1 to 1,024.
    pub merge_trigger_generations: NonZeroUsize,
    /// Handler state entries (puts, deletes, uniqueness marks, versions) buffered in memory
    /// per subscriber and shard, and logged, before they are applied to the sorted state
    /// tables in key order. Larger: fewer, denser rewrites of the tables; more memory
    /// (roughly 150-250 bytes per entry, up to twice this many while one buffer is applied).
    /// 16 to 4,194,304.
    pub state_buffer_entries: NonZeroUsize,
    /// redb page cache per shard, in MiB. The OS page cache serves the rest. 1 to 65,536.
    pub cache_mib: NonZeroUsize,
    /// Verify every page checksum when a shard file is opened, so a file damaged outside
    /// dedupd is reported instead of trusted. Reads the whole file at start-up.
    pub verify_on_open: bool,
    /// Most subscribers that are not in the config (created by the first message that
    /// names them, when `allow_unknown_subscribers` is true; those found in the data
    /// directory count too). Each costs memory on every shard; past the limit a message
    /// for a new name is refused (HTTP 403 `subscriber_limit`). Configured subscribers are
    /// never limited. 0 to 65,536.
    pub max_implicit_subscribers: usize,
    /// How long a quarantine or dead-letter record is kept after it was first stored; older
    /// ones are removed between batches (the outcomes stay counted).
    #[serde(with = "humantime_serde")]
    pub record_retention: Duration,
    /// Most quarantine records, and separately most dead-letter records, kept per
    /// subscriber (split evenly over the shards). Past it the oldest record is dropped and
    /// counted in `dedupd_records_dropped_total`; the outcome is still reported and counted.
    pub max_records_per_subscriber: NonZeroUsize,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            shards: None,
            max_batch: nz(16_384),
            max_linger: Duration::ZERO,
            generation_max_claims: nz(440_000),
            generation_max_age: Duration::from_secs(3600),
            merge_max_claims: nz(1 << 23),
            merge_trigger_generations: nz(8),
            state_buffer_entries: nz(1 << 17),
            cache_mib: nz(32),
            verify_on_open: true,
            max_implicit_subscribers: 64,
            record_retention: Duration::from_secs(30 * 24 * 3600),
            max_records_per_subscriber: nz(100_000),
        }
    }
}

impl LedgerConfig {
    /// Claims a busy subscriber's full-size index is allocated for: a generation, plus the
    /// batch that fills it, which ends before the generation is sealed. Smaller, and the
    /// last batch rehashed the table into twice the memory inside the batch.
    pub fn full_index_claims(&self) -> usize {
        self.generation_max_claims.get() + self.max_batch.get()
    }

    /// Every count within its documented range, so a nonsense value is refused here with
    /// the field's name instead of exhausting memory (or overflowing) in a shard thread.
    fn validate_sizes(&self) -> Result<(), ConfigError> {
        let sizes = [
            ("max_batch", self.max_batch.get(), 1, 1 << 20),
            (
                "generation_max_claims",
                self.generation_max_claims.get(),
                16,
                1 << 24,
            ),
            ("merge_max_claims", self.merge_max_claims.get(), 16, 1 << 30),
            (
                "merge_trigger_generations",
                self.merge_trigger_generations.get(),
                1,
                1024,
            ),
            (
                "state_buffer_entries",
                self.state_buffer_entries.get(),
                16,
                1 << 22,
            ),
            ("cache_mib", self.cache_mib.get(), 1, 1 << 16),
            (
                "max_implicit_subscribers",
                self.max_implicit_subscribers,
                0,
                1 << 16,
            ),
        ];
        for (field, value, min, max) in sizes {
            if !(min..=max).contains(&value) {
                return Err(invalid(
                    format!("ledger.{field}"),
                    format!("is {value}; it must be between {min} and {max}"),
                ));
            }
        }
        Ok(())
    }
}

/// Limits of pipe mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipeConfig {
    /// Longest input line in bytes (line ending excluded). A longer line is answered
    /// `rejected` without being kept in memory, and the stream goes on.
    pub max_line_bytes: NonZeroUsize,
    /// Lines read but not yet printed before reading pauses. Bounds memory when the head
    /// line waits (for a handler retry, say): stdin is not read further until it is printed.
    pub window: NonZeroUsize,
    /// Bytes of lines read but not yet printed before reading pauses (one line more may
    /// be read): with `window` alone, memory was bounded only by `window` x
    /// `max_line_bytes`, 64 GiB at the defaults.
    pub max_bytes_in_flight: NonZeroUsize,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            max_line_bytes: nz(1 << 20),
            window: nz(65_536),
            max_bytes_in_flight: nz(256 << 20),
        }
    }
}

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

/// Where a subscriber's idempotency key comes from.
///
/// Read through [`SourceSpec`]: serde's internally tagged enums drop unknown fields of
/// unit variants (`{ source = "id", pointer = "/x" }` loaded as `id`), and a typo in a key
/// source changes what is deduplicated, so every field a source does not take is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "source",
    rename_all = "snake_case",
    deny_unknown_fields,
    try_from = "SourceSpec"
)]
pub enum KeySource {
    /// The envelope's `id` field.
    Id,
    /// A header value.
    Header { name: String },
    /// A JSON pointer (RFC 6901) into the payload, e.g. `/order/id`; or, as `pointers`,
    /// several whose values together are the key (a composite key such as
    /// `["/tenant", "/order_id"]`). Exactly one of the two is given.
    JsonPointer {
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pointer: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pointers: Vec<String>,
    },
    /// CloudEvents: `source` + `id`, from the payload (structured mode) or the
    /// `ce_source`/`ce_id` headers (binary mode).
    Cloudevents,
    /// A hash of the canonical payload. Opt-in only: two different events with equal
    /// payloads become duplicates.
    ContentHash,
}

/// The entity of a handler subscriber's state (see "Placements" in `docs/design.md`):
/// messages that share a partition key run on the same shard and see one store of their
/// own. Without a handler it is not used; the idempotency key (the default) means "no
/// entity": the handler's state is one store and it runs on one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "source",
    rename_all = "snake_case",
    deny_unknown_fields,
    try_from = "SourceSpec"
)]
pub enum PartitionSource {
    /// No entity: a handler's state is one store (and the handler runs on one shard).
    #[default]
    IdempotencyKey,
    /// The envelope's `key` field (a Kafka record key, say).
    EnvelopeKey,
    /// A header value.
    Header { name: String },
    /// A JSON pointer into the payload, e.g. `/order_id`.
    JsonPointer { pointer: String },
}

/// A key or partition key source as written: every field any source takes, checked
/// against the ones the named source takes when it becomes a [`KeySource`] or
/// [`PartitionSource`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    source: String,
    name: Option<String>,
    pointer: Option<String>,
    pointers: Option<Vec<String>>,
}

impl SourceSpec {
    /// Refuses the fields that are given but not in `takes`.
    fn only(&self, takes: &[&str]) -> Result<(), String> {
        let given = [
            ("name", self.name.is_some()),
            ("pointer", self.pointer.is_some()),
            ("pointers", self.pointers.is_some()),
        ];
        match given.iter().find(|(f, set)| *set && !takes.contains(f)) {
            None => Ok(()),
            Some((field, _)) if takes.is_empty() => Err(format!(
                "source `{}` takes no other field, but `{field}` is given",
                self.source
            )),
            Some((field, _)) => Err(format!(
                "source `{}` takes {}, not `{field}`",
                self.source,
                takes
                    .iter()
                    .map(|t| format!("`{t}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )),
        }
    }

    fn name(self) -> Result<String, String> {
        let source = self.source;
        self.name
            .ok_or_else(|| format!("source `{source}` needs `name` (the header's name)"))
    }
}

impl TryFrom<SourceSpec> for KeySource {
    type Error = String;

    fn try_from(s: SourceSpec) -> Result<KeySource, String> {
        match s.source.as_str() {
            "id" => s.only(&[]).map(|_| KeySource::Id),
            "cloudevents" => s.only(&[]).map(|_| KeySource::Cloudevents),
            "content_hash" => s.only(&[]).map(|_| KeySource::ContentHash),
            "header" => {
                s.only(&["name"])?;
                Ok(KeySource::Header { name: s.name()? })
            }
            "json_pointer" => {
                s.only(&["pointer", "pointers"])?;
                Ok(KeySource::JsonPointer {
                    pointer: s.pointer.unwrap_or_default(),
                    pointers: s.pointers.unwrap_or_default(),
                })
            }
            other => Err(format!(
                "unknown key source `{other}`: use id, header, json_pointer, cloudevents or content_hash"
            )),
        }
    }
}

impl TryFrom<SourceSpec> for PartitionSource {
    type Error = String;

    fn try_from(s: SourceSpec) -> Result<PartitionSource, String> {
        match s.source.as_str() {
            "idempotency_key" => s.only(&[]).map(|_| PartitionSource::IdempotencyKey),
            "envelope_key" => s.only(&[]).map(|_| PartitionSource::EnvelopeKey),
            "header" => {
                s.only(&["name"])?;
                Ok(PartitionSource::Header { name: s.name()? })
            }
            "json_pointer" => {
                s.only(&["pointer"])?;
                let source = s.source.clone();
                Ok(PartitionSource::JsonPointer {
                    pointer: s
                        .pointer
                        .ok_or_else(|| format!("source `{source}` needs `pointer`"))?,
                })
            }
            other => Err(format!(
                "unknown partition key source `{other}`: use idempotency_key, envelope_key, header or json_pointer"
            )),
        }
    }
}

/// Per-subscriber behaviour.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SubscriberSettings {
    /// How long a claim is remembered. Must exceed the longest redelivery window of the source.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// Refresh a claim's expiry each time a duplicate arrives.
    pub sliding_ttl: bool,
    /// Where the idempotency key comes from.
    pub key: KeySource,
    /// Keys longer than this are rejected.
    pub max_key_bytes: usize,
    /// The entity of handler state (a store per value); unused without a handler. A
    /// redelivery may carry another one: its claim is still found.
    pub partition_key: PartitionSource,
    /// WebAssembly component run for each new message (none: claim only).
    pub handler: Option<PathBuf>,
    /// Budget of one handler call: guest CPU and waits on the clock (a sleep) together.
    #[serde(with = "humantime_serde")]
    pub handler_cpu_budget: Duration,
    /// Cap of all linear memories of a handler instance together, in MiB.
    pub handler_memory_mib: usize,
    /// State writes one handler call may make (put, delete, and compare-and-set,
    /// insert-unique, advance-version when they write); more is a trap.
    pub handler_max_writes: usize,
    /// MiB of state (keys and values) and outbox messages one handler call may write;
    /// more is a trap.
    pub handler_max_write_mib: usize,
    /// Attempts before a failing message is dead-lettered (permanent errors: at once).
    pub max_attempts: u32,
    /// Delay before the second attempt; doubles for each further one.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// Longest delay between two attempts, where the doubling of `retry_backoff` stops: a
    /// message waiting for its next attempt is held in memory and holds back its source's
    /// committed offset.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// Handler calls in a row stopped by the sandbox (trap, CPU budget, memory cap) on one
    /// shard that open the subscriber's circuit breaker there: for
    /// `handler_breaker_cooldown` its messages use up attempts without a call and wait, so
    /// a broken handler does not spend its shard's time that other subscribers need (a
    /// message whose attempts are used up is dead-lettered). 0: never opens.
    pub handler_breaker_failures: u32,
    /// How long an open breaker refuses calls; then one call decides (closes or reopens).
    #[serde(with = "humantime_serde")]
    pub handler_breaker_cooldown: Duration,
    /// What of a JSON payload the fingerprint covers (G4).
    #[serde(default)]
    pub fingerprint: FingerprintSpec,
}

/// Which parts of a JSON payload the fingerprint covers. A producer that re-stamps a
/// field on every retry (`/sent_at`, `/trace_id`) would otherwise turn its own retries
/// into quarantined mismatches. Changing it changes the fingerprint of every message:
/// a redelivery of a message claimed before the change is quarantined as a mismatch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FingerprintSpec {
    /// JSON pointers (RFC 6901) left out of the fingerprint; a missing one is no error.
    /// Handlers still get the whole payload. Empty: the whole payload counts.
    #[serde(default)]
    pub ignore: Vec<String>,
}

impl Default for SubscriberSettings {
    fn default() -> Self {
        SubscriberSettings {
            ttl: Duration::from_secs(7 * 24 * 3600),
            sliding_ttl: false,
            key: KeySource::Id,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            partition_key: PartitionSource::IdempotencyKey,
            handler: None,
            handler_cpu_budget: Duration::from_millis(10),
            handler_memory_mib: 32,
            handler_max_writes: 10_000,
            handler_max_write_mib: 16,
            max_attempts: 3,
            retry_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(60),
            handler_breaker_failures: 5,
            handler_breaker_cooldown: Duration::from_secs(5),
            fingerprint: FingerprintSpec::default(),
        }
    }
}

/// A named subscriber. Fields left out inherit from `[defaults]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubscriberConfig {
    /// `[A-Za-z0-9._-]{1,64}`; part of table names on disk.
    pub name: String,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub ttl: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_ttl: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_key_bytes: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_key: Option<PartitionSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler: Option<PathBuf>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub handler_cpu_budget: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_memory_mib: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_max_writes: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_max_write_mib: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub retry_backoff: Option<Duration>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_backoff: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_breaker_failures: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub handler_breaker_cooldown: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<FingerprintSpec>,
}

impl SubscriberConfig {
    /// These settings over `defaults`.
    pub fn resolve(&self, defaults: &SubscriberSettings) -> SubscriberSettings {
        SubscriberSettings {
            ttl: self.ttl.unwrap_or(defaults.ttl),
            sliding_ttl: self.sliding_ttl.unwrap_or(defaults.sliding_ttl),
            key: self.key.clone().unwrap_or_else(|| defaults.key.clone()),
            max_key_bytes: self.max_key_bytes.unwrap_or(defaults.max_key_bytes),
            partition_key: self
                .partition_key
                .clone()
                .unwrap_or_else(|| defaults.partition_key.clone()),
            handler: self.handler.clone().or_else(|| defaults.handler.clone()),
            handler_cpu_budget: self
                .handler_cpu_budget
                .unwrap_or(defaults.handler_cpu_budget),
            handler_memory_mib: self
                .handler_memory_mib
                .unwrap_or(defaults.handler_memory_mib),
            handler_max_writes: self
                .handler_max_writes
                .unwrap_or(defaults.handler_max_writes),
            handler_max_write_mib: self
                .handler_max_write_mib
                .unwrap_or(defaults.handler_max_write_mib),
            max_attempts: self.max_attempts.unwrap_or(defaults.max_attempts),
            retry_backoff: self.retry_backoff.unwrap_or(defaults.retry_backoff),
            max_backoff: self.max_backoff.unwrap_or(defaults.max_backoff),
            handler_breaker_failures: self
                .handler_breaker_failures
                .unwrap_or(defaults.handler_breaker_failures),
            handler_breaker_cooldown: self
                .handler_breaker_cooldown
                .unwrap_or(defaults.handler_breaker_cooldown),
            fingerprint: self
                .fingerprint
                .clone()
                .unwrap_or_else(|| defaults.fingerprint.clone()),
        }
    }
}

impl Config {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })?;
        // Handler paths are relative to the config file, like includes in most tools.
        let base = path.parent().unwrap_or(Path::new("."));
        let rebase = |p: &mut Option<PathBuf>| {
            if let Some(h) = p.as_mut().filter(|h| h.is_relative()) {
                *h = base.join(&*h);
            }
        };
        rebase(&mut config.defaults.handler);
        for s in &mut config.subscribers {
            rebase(&mut s.handler);
        }
        Ok(config)
    }

    /// Parses and validates TOML text, with `${NAME}` in strings replaced by environment
    /// variables (see `config/env.rs`).
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, &|name| std::env::var(name).ok())
    }

    fn parse_with_env(
        text: &str,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let parse_error = |e: &dyn std::fmt::Display| ConfigError::Parse {
            path: PathBuf::from("<text>"),
            message: e.to_string(),
        };
        // Variables are expanded before the settings are read: a duration or an address
        // written as `"${TTL}"` is only a duration once expanded. Without any, the text is
        // read as it is, so errors point at a line and column.
        let config: Config = if text.contains("${") {
            let mut value: toml::Value = toml::from_str(text).map_err(|e| parse_error(&e))?;
            env::expand(&mut value, "", lookup)?;
            value.try_into().map_err(|e| parse_error(&e))?
        } else {
            toml::from_str(text).map_err(|e| parse_error(&e))?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks cross-field rules that types alone cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_settings("defaults", &self.defaults)?;
        validate_subscriber_name("default_subscriber", &self.default_subscriber)?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, s) in self.subscribers.iter().enumerate() {
            validate_subscriber_name(&format!("subscriber[{i}].name"), &s.name)?;
            if !seen.insert(s.name.as_str()) {
                return Err(invalid(
                    format!("subscriber[{i}].name"),
                    format!("repeats subscriber {:?}", s.name),
                ));
            }
            validate_settings(&format!("subscriber[{i}]"), &s.resolve(&self.defaults))?;
        }
        if let Some(shards) = self.ledger.shards {
            if shards.get() > 256 {
                return Err(invalid("ledger.shards", "must be at most 256"));
            }
        }
        self.ledger.validate_sizes()?;
        if self.ledger.max_linger > Duration::from_secs(1) {
            return Err(invalid(
                "ledger.max_linger",
                "must be at most 1s (it adds directly to ack latency)",
            ));
        }
        if self.ledger.generation_max_age < Duration::from_secs(1) {
            return Err(invalid("ledger.generation_max_age", "must be at least 1s"));
        }
        if self.ledger.record_retention < Duration::from_secs(1) {
            return Err(invalid("ledger.record_retention", "must be at least 1s"));
        }
        if self.pipe.max_line_bytes.get() > 1 << 30 {
            return Err(invalid("pipe.max_line_bytes", "must be at most 1 GiB"));
        }
        if let Some(kafka) = &self.kafka {
            kafka.validate(self)?;
        }
        Ok(())
    }

    /// The settings for a subscriber, or `None` if it is unknown and unknown ones are refused.
    pub fn settings_for(&self, name: &str) -> Option<SubscriberSettings> {
        match self.subscribers.iter().find(|s| s.name == name) {
            Some(s) => Some(s.resolve(&self.defaults)),
            None if self.allow_unknown_subscribers => Some(self.defaults.clone()),
            None => None,
        }
    }
}

fn validate_settings(field: &str, s: &SubscriberSettings) -> Result<(), ConfigError> {
    if s.ttl < Duration::from_secs(1) {
        return Err(invalid(format!("{field}.ttl"), "must be at least 1s"));
    }
    if s.ttl > Duration::from_secs(10 * 365 * 24 * 3600) {
        return Err(invalid(format!("{field}.ttl"), "must be at most 10 years"));
    }
    if s.max_key_bytes == 0 || s.max_key_bytes > 64 * 1024 {
        return Err(invalid(
            format!("{field}.max_key_bytes"),
            "must be between 1 and 65536",
        ));
    }
    if s.handler_cpu_budget < Duration::from_millis(1)
        || s.handler_cpu_budget > Duration::from_secs(60)
    {
        return Err(invalid(
            format!("{field}.handler_cpu_budget"),
            "must be between 1ms and 60s",
        ));
    }
    if s.handler_memory_mib == 0 || s.handler_memory_mib > 4096 {
        return Err(invalid(
            format!("{field}.handler_memory_mib"),
            "must be between 1 and 4096",
        ));
    }
    if s.handler_max_writes == 0 || s.handler_max_writes > 1_000_000 {
        return Err(invalid(
            format!("{field}.handler_max_writes"),
            "must be between 1 and 1000000",
        ));
    }
    if s.handler_max_write_mib == 0 || s.handler_max_write_mib > 1024 {
        return Err(invalid(
            format!("{field}.handler_max_write_mib"),
            "must be between 1 and 1024",
        ));
    }
    if s.max_attempts == 0 || s.max_attempts > 100 {
        return Err(invalid(
            format!("{field}.max_attempts"),
            "must be between 1 and 100",
        ));
    }
    if s.retry_backoff > Duration::from_secs(600) {
        return Err(invalid(
            format!("{field}.retry_backoff"),
            "must be at most 10m",
        ));
    }
    if s.max_backoff > Duration::from_secs(3600) {
        return Err(invalid(
            format!("{field}.max_backoff"),
            "must be at most 1h",
        ));
    }
    if s.max_backoff < s.retry_backoff {
        return Err(invalid(
            format!("{field}.max_backoff"),
            "must be at least retry_backoff (raise max_backoff or lower retry_backoff)",
        ));
    }
    if s.handler_breaker_failures > 1_000_000 {
        return Err(invalid(
            format!("{field}.handler_breaker_failures"),
            "must be at most 1000000 (0 turns the breaker off)",
        ));
    }
    if s.handler_breaker_cooldown < Duration::from_millis(1)
        || s.handler_breaker_cooldown > Duration::from_secs(3600)
    {
        return Err(invalid(
            format!("{field}.handler_breaker_cooldown"),
            "must be between 1ms and 1h",
        ));
    }
    for (i, pointer) in s.fingerprint.ignore.iter().enumerate() {
        if !pointer.starts_with('/') {
            return Err(invalid(
                format!("{field}.fingerprint.ignore[{i}]"),
                format!("{pointer:?} is not a JSON pointer: it must start with `/` (the whole payload cannot be ignored)"),
            ));
        }
    }
    match &s.key {
        KeySource::Header { name } if name.is_empty() => {
            return Err(invalid(format!("{field}.key.name"), "must not be empty"))
        }
        KeySource::JsonPointer { pointer, pointers } => {
            if pointer.is_empty() == pointers.is_empty() {
                return Err(invalid(
                    format!("{field}.key"),
                    "json_pointer takes `pointer` (one JSON pointer) or `pointers` (a composite key), exactly one of them",
                ));
            }
            if !pointer.is_empty() && !pointer.starts_with('/') {
                return Err(invalid(
                    format!("{field}.key.pointer"),
                    "must be a JSON pointer starting with '/'",
                ));
            }
            for (i, p) in pointers.iter().enumerate() {
                if !p.starts_with('/') {
                    return Err(invalid(
                        format!("{field}.key.pointers[{i}]"),
                        format!("{p:?} must be a JSON pointer starting with '/'"),
                    ));
                }
                if pointers[..i].contains(p) {
                    return Err(invalid(
                        format!("{field}.key.pointers[{i}]"),
                        format!("{p:?} is listed twice"),
                    ));
                }
            }
        }
        _ => {}
    }
    // A pointer without '/' or an empty header name would match no message: every one
    // would be rejected at run time for a missing partition key.
    match &s.partition_key {
        PartitionSource::Header { name } if name.is_empty() => Err(invalid(
            format!("{field}.partition_key.name"),
            "must not be empty",
        )),
        PartitionSource::JsonPointer { pointer } if !pointer.starts_with('/') => Err(invalid(
            format!("{field}.partition_key.pointer"),
            "must be a JSON pointer starting with '/'",
        )),
        _ => Ok(()),
    }
}

/// Subscriber names become part of table names, so they are kept to a safe alphabet.
pub fn validate_subscriber_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        // Names become file and directory names (handler store, backups): never `.` or `..`.
        && !name.bytes().all(|b| b == b'.');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{name:?} is not a valid subscriber name (1-64 of A-Z a-z 0-9 . _ -, not only dots)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `${NAME}` in strings reads the environment (here a fake one); an unset name is an
    /// error that names the field.
    #[test]
    fn environment_variables_fill_config_strings() {
        let text = "[http]\nbind = \"127.0.0.1:0\"\ntoken = \"${DEDUPD_TOKEN}\"\n";
        let c = Config::parse_with_env(text, &|n| (n == "DEDUPD_TOKEN").then(|| "t0ken".into()))
            .unwrap();
        assert_eq!(c.http.unwrap().token.as_deref(), Some("t0ken"));
        let e = Config::parse_with_env(text, &|_| None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http.token") && e.contains("DEDUPD_TOKEN"),
            "{e}"
        );
    }

    /// Settings that are strings in TOML but not text to dedupd (durations, addresses)
    /// take variables too: they are expanded before the file is read into settings.
    #[test]
    fn environment_variables_fill_durations_and_addresses() {
        let text = "[defaults]\nttl = \"${TTL}\"\n[http]\nbind = \"${BIND:-127.0.0.1:8080}\"\n";
        let env = |n: &str| (n == "TTL").then(|| "7d".to_string());
        let c = Config::parse_with_env(text, &env).unwrap();
        assert_eq!(c.defaults.ttl, Duration::from_secs(7 * 86_400));
        assert_eq!(c.http.unwrap().bind, "127.0.0.1:8080".parse().unwrap());
    }

    /// The sample shipped in the repository must stay valid.
    #[test]
    fn sample_config_parses() {
        let text = include_str!("../dedupd.example.toml");
        let config = Config::parse(text).expect("sample config");
        assert_eq!(config.subscribers.len(), 2);
        let billing = config.settings_for("billing").expect("billing");
        assert_eq!(
            billing.key,
            KeySource::JsonPointer {
                pointer: "/order_id".into(),
                pointers: vec![]
            }
        );
        assert!(billing.sliding_ttl);
        assert_eq!(
            billing.max_key_bytes, DEFAULT_MAX_KEY_BYTES,
            "inherited from defaults"
        );
        // The sample lists the defaults.
        let d = SubscriberSettings::default();
        assert_eq!(
            (billing.handler_max_writes, billing.handler_max_write_mib),
            (d.handler_max_writes, d.handler_max_write_mib)
        );
        assert_eq!(billing.max_backoff, d.max_backoff);
        assert_eq!(
            (
                billing.handler_breaker_failures,
                billing.handler_breaker_cooldown
            ),
            (d.handler_breaker_failures, d.handler_breaker_cooldown)
        );
        assert_eq!(config.pipe, PipeConfig::default());
    }

    #[test]
    fn empty_config_is_valid() {
        let config = Config::parse("").expect("empty config");
        assert_eq!(config.default_subscriber, "default");
        assert!(config.settings_for("anything").is_some());
    }

    #[test]
    fn unknown_field_is_refused() {
        let err = Config::parse("[ledger]\nmax_bach = 3\n").unwrap_err();
        assert!(err.to_string().contains("max_bach"), "{err}");
    }

    #[test]
    fn unknown_subscriber_field_is_refused() {
        let err = Config::parse("[[subscriber]]\nname = \"a\"\nttll = \"1h\"\n").unwrap_err();
        assert!(err.to_string().contains("ttll"), "{err}");
    }

    #[test]
    fn handler_write_bounds_out_of_range_are_refused() {
        let err = Config::parse("[defaults]\nhandler_max_writes = 0\n").unwrap_err();
        assert!(
            err.to_string().contains("defaults.handler_max_writes"),
            "{err}"
        );
        let text = "[[subscriber]]\nname = \"a\"\nhandler_max_write_mib = 1025\n";
        let err = Config::parse(text).unwrap_err();
        assert!(
            err.to_string()
                .contains("subscriber[0].handler_max_write_mib"),
            "{err}"
        );
        let text = "[[subscriber]]\nname = \"a\"\nhandler_max_writes = 1000000\nhandler_max_write_mib = 1024\n";
        let a = Config::parse(text).unwrap().settings_for("a").unwrap();
        assert_eq!(
            (a.handler_max_writes, a.handler_max_write_mib),
            (1_000_000, 1024)
        );
    }

    #[test]
    fn max_backoff_defaults_to_one_minute_and_can_be_set() {
        let d = Config::parse("").unwrap().settings_for("a").unwrap();
        assert_eq!(d.max_backoff, Duration::from_secs(60));
        let text = "[[subscriber]]\nname = \"a\"\nretry_backoff = \"2m\"\nmax_backoff = \"5m\"\n";
        let a = Config::parse(text).unwrap().settings_for("a").unwrap();
        assert_eq!(a.max_backoff, Duration::from_secs(300));
    }

    #[test]
    fn max_backoff_below_retry_backoff_or_over_an_hour_is_refused() {
        let text = "[[subscriber]]\nname = \"a\"\nretry_backoff = \"2s\"\nmax_backoff = \"1s\"\n";
        let err = Config::parse(text).unwrap_err();
        assert!(
            err.to_string().contains("subscriber[0].max_backoff"),
            "{err}"
        );
        let err = Config::parse("[defaults]\nmax_backoff = \"2h\"\n").unwrap_err();
        assert!(err.to_string().contains("defaults.max_backoff"), "{err}");
    }

    #[test]
    fn zero_batch_is_refused() {
        assert!(Config::parse("[ledger]\nmax_batch = 0\n").is_err());
    }

    /// Each bounded ledger count with its lowest and highest allowed value.
    const LEDGER_BOUNDS: &[(&str, usize, usize)] = &[
        ("max_batch", 1, 1 << 20),
        ("generation_max_claims", 16, 1 << 24),
        ("merge_max_claims", 16, 1 << 30),
        ("merge_trigger_generations", 1, 1024),
        ("state_buffer_entries", 16, 1 << 22),
        ("cache_mib", 1, 1 << 16),
        ("max_implicit_subscribers", 0, 1 << 16),
    ];

    #[test]
    fn ledger_size_bounds_obeyed() {
        for &(field, min, max) in LEDGER_BOUNDS {
            for value in [min, max] {
                let text = format!("[ledger]\n{field} = {value}\n");
                if let Err(e) = Config::parse(&text) {
                    panic!("{field} = {value} must be accepted: {e}");
                }
            }
        }
        // The values tests and benches use stay valid.
        let small = "[ledger]\ngeneration_max_claims = 40\nmerge_max_claims = 200\nmerge_trigger_generations = 2\nstate_buffer_entries = 64\nmax_batch = 1024\n";
        assert!(Config::parse(small).is_ok());
    }

    #[test]
    fn ledger_size_bounds_violated() {
        for &(field, min, max) in LEDGER_BOUNDS {
            let mut values = vec![max + 1, usize::MAX >> 1];
            if min > 1 {
                values.push(min - 1);
            }
            for value in values {
                let text = format!("[ledger]\n{field} = {value}\n");
                let err = Config::parse(&text).expect_err(field).to_string();
                assert!(
                    err.contains(&format!("ledger.{field}"))
                        && err.contains(&format!("between {min} and {max}")),
                    "{field} = {value}: {err}"
                );
            }
        }
    }

    /// `pointers` makes a composite key; `pointer` and `pointers` together, neither, a
    /// part that is not a pointer or one listed twice are refused naming the field.
    #[test]
    fn composite_json_pointer_keys_parse_and_bad_ones_are_refused() {
        let sub = |key: &str| format!("[[subscriber]]\nname = \"a\"\nkey = {key}\n");
        let ok = Config::parse(&sub(
            r#"{ source = "json_pointer", pointers = ["/tenant", "/order_id"] }"#,
        ))
        .unwrap();
        assert_eq!(
            ok.settings_for("a").unwrap().key,
            KeySource::JsonPointer {
                pointer: String::new(),
                pointers: vec!["/tenant".into(), "/order_id".into()],
            }
        );
        for (key, field) in [
            (
                r#"{ source = "json_pointer", pointer = "/a", pointers = ["/b"] }"#,
                "`subscriber[0].key` json_pointer takes",
            ),
            (
                r#"{ source = "json_pointer" }"#,
                "`subscriber[0].key` json_pointer takes",
            ),
            (
                r#"{ source = "json_pointer", pointers = ["/a", "b"] }"#,
                "subscriber[0].key.pointers[1]",
            ),
            (
                r#"{ source = "json_pointer", pointers = ["/a", "/a"] }"#,
                "subscriber[0].key.pointers[1]",
            ),
        ] {
            let err = Config::parse(&sub(key)).unwrap_err().to_string();
            assert!(err.contains(field), "{key}: {err}");
        }
    }

    /// A field the named source does not take is refused, naming it: serde alone drops
    /// unknown fields of sources without fields (`id`, `cloudevents`...).
    #[test]
    fn key_source_fields_the_source_does_not_take_are_refused() {
        for (section, value, needle) in [
            ("key", r#"{ source = "id", pointer = "/x" }"#, "`pointer`"),
            ("key", r#"{ source = "cloudevents", name = "x" }"#, "`name`"),
            (
                "key",
                r#"{ source = "content_hash", pointers = ["/a"] }"#,
                "`pointers`",
            ),
            (
                "key",
                r#"{ source = "header", pointer = "/x", name = "x" }"#,
                "`pointer`",
            ),
            ("key", r#"{ source = "header" }"#, "needs `name`"),
            (
                "key",
                r#"{ source = "json_pointer", pointer = "/x", nmae = "y" }"#,
                "nmae",
            ),
            ("key", r#"{ source = "idd" }"#, "unknown key source"),
            (
                "partition_key",
                r#"{ source = "envelope_key", name = "k" }"#,
                "`name`",
            ),
            (
                "partition_key",
                r#"{ source = "json_pointer", pointers = ["/a"] }"#,
                "`pointers`",
            ),
        ] {
            let text = format!("[[subscriber]]\nname = \"a\"\n{section} = {value}\n");
            let err = Config::parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{value}: {err}");
        }
        let ok = "[[subscriber]]\nname = \"a\"\nkey = { source = \"id\" }\npartition_key = { source = \"header\", name = \"x\" }\n";
        assert!(Config::parse(ok).is_ok());
    }

    #[test]
    fn partition_key_pointer_without_slash_is_refused() {
        let text = "[[subscriber]]\nname = \"a\"\npartition_key = { source = \"json_pointer\", pointer = \"order_id\" }\n";
        let err = Config::parse(text).unwrap_err().to_string();
        assert!(err.contains("subscriber[0].partition_key.pointer"), "{err}");
        let text = "[defaults]\npartition_key = { source = \"header\", name = \"\" }\n";
        let err = Config::parse(text).unwrap_err().to_string();
        assert!(err.contains("defaults.partition_key.name"), "{err}");
        let ok =
            "[defaults]\npartition_key = { source = \"json_pointer\", pointer = \"/order_id\" }\n";
        assert!(Config::parse(ok).is_ok());
    }

    #[test]
    fn bad_subscriber_name_is_refused() {
        let err = Config::parse("[[subscriber]]\nname = \"a/b\"\n").unwrap_err();
        assert!(err.to_string().contains("subscriber[0].name"), "{err}");
    }

    #[test]
    fn short_ttl_is_refused() {
        let err = Config::parse("[defaults]\nttl = \"10ms\"\n").unwrap_err();
        assert!(err.to_string().contains("defaults.ttl"), "{err}");
    }

    #[test]
    fn unknown_subscriber_refused_when_disallowed() {
        let config = Config::parse("allow_unknown_subscribers = false\n").expect("config");
        assert!(config.settings_for("nobody").is_none());
    }
}
