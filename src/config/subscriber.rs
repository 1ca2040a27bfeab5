//! `[defaults]` and `[[subscriber]]`: a subscriber's settings, the fields a named
//! subscriber overrides, and the checks every resolved setting and name passes.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError, KeySource, PartitionSource, DEFAULT_MAX_KEY_BYTES};

/// Per-subscriber behaviour.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SubscriberSettings {
    /// How long a claim is remembered. Must exceed the longest redelivery window of the source.
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String, default = default_ttl)]
    pub ttl: Duration,
    /// Refresh a claim's expiry each time a duplicate arrives.
    pub(crate) sliding_ttl: bool,
    /// Where the idempotency key comes from.
    pub(crate) key: KeySource,
    /// Keys longer than this are rejected.
    pub(crate) max_key_bytes: usize,
    /// The entity of handler state (a store per value); unused without a handler. A
    /// redelivery may carry another one: its claim is still found.
    pub(crate) partition_key: PartitionSource,
    /// WebAssembly component run for each new message (none: claim only).
    #[schema(value_type = Option<String>)]
    pub(crate) handler: Option<PathBuf>,
    /// Budget of one handler call: guest CPU and waits on the clock (a sleep) together.
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String, default = default_handler_cpu_budget)]
    pub(crate) handler_cpu_budget: Duration,
    /// Cap of all linear memories of a handler instance together, in MiB.
    pub(crate) handler_memory_mib: usize,
    /// State writes one handler call may make (put, delete, and compare-and-set,
    /// insert-unique, advance-version when they write); more is a trap.
    pub(crate) handler_max_writes: usize,
    /// MiB of state (keys and values) and outbox messages one handler call may write;
    /// more is a trap.
    pub(crate) handler_max_write_mib: usize,
    /// Attempts before a failing message is dead-lettered (permanent errors: at once).
    pub(crate) max_attempts: u32,
    /// Delay before the second attempt; doubles for each further one.
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String, default = default_retry_backoff)]
    pub(crate) retry_backoff: Duration,
    /// Longest delay between two attempts, where the doubling of `retry_backoff` stops: a
    /// message waiting for its next attempt is held in memory and holds back its source's
    /// committed offset.
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String, default = default_max_backoff)]
    pub(crate) max_backoff: Duration,
    /// Handler calls in a row stopped by the sandbox (trap, CPU budget, memory cap) on one
    /// shard that open the subscriber's circuit breaker there: for
    /// `handler_breaker_cooldown` its messages use up attempts without a call and wait, so
    /// a broken handler does not spend its shard's time that other subscribers need (a
    /// message whose attempts are used up is dead-lettered). 0: never opens.
    pub handler_breaker_failures: u32,
    /// How long an open breaker refuses calls; then one call decides (closes or reopens).
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String, default = default_handler_breaker_cooldown)]
    pub handler_breaker_cooldown: Duration,
    /// What of a JSON payload the fingerprint covers (G4).
    #[serde(default)]
    pub(crate) fingerprint: FingerprintSpec,
}

/// Which parts of a JSON payload the fingerprint covers. A producer that re-stamps a
/// field on every retry (`/sent_at`, `/trace_id`) would otherwise turn its own retries
/// into quarantined mismatches. Changing it changes the fingerprint of every message:
/// a redelivery of a message claimed before the change is quarantined as a mismatch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FingerprintSpec {
    /// JSON pointers (RFC 6901) left out of the fingerprint; a missing one is no error.
    /// Handlers still get the whole payload. Empty: the whole payload counts.
    #[serde(default)]
    pub(crate) ignore: Vec<String>,
}

/// A duration setting's default as the config and the API write it (`7days`, `10ms`): the
/// `default` of its schema in `/openapi.json`.
fn shown_default(pick: fn(&SubscriberSettings) -> Duration) -> String {
    humantime::format_duration(pick(&SubscriberSettings::default())).to_string()
}

fn default_ttl() -> String {
    shown_default(|s| s.ttl)
}

fn default_handler_cpu_budget() -> String {
    shown_default(|s| s.handler_cpu_budget)
}

fn default_retry_backoff() -> String {
    shown_default(|s| s.retry_backoff)
}

fn default_max_backoff() -> String {
    shown_default(|s| s.max_backoff)
}

fn default_handler_breaker_cooldown() -> String {
    shown_default(|s| s.handler_breaker_cooldown)
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
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriberConfig {
    /// `[A-Za-z0-9._-]{1,64}`; part of table names on disk.
    pub name: String,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>)]
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
    #[schema(value_type = Option<String>)]
    pub handler: Option<PathBuf>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>)]
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
    #[schema(value_type = Option<String>)]
    pub retry_backoff: Option<Duration>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>)]
    pub max_backoff: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_breaker_failures: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>)]
    pub handler_breaker_cooldown: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<FingerprintSpec>,
}

impl SubscriberConfig {
    /// These settings over `defaults`.
    pub(crate) fn resolve(&self, defaults: &SubscriberSettings) -> SubscriberSettings {
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

pub(super) fn validate_settings(field: &str, s: &SubscriberSettings) -> Result<(), ConfigError> {
    validate_limits(field, s)?;
    for (i, pointer) in s.fingerprint.ignore.iter().enumerate() {
        if !pointer.starts_with('/') {
            return Err(invalid(
                format!("{field}.fingerprint.ignore[{i}]"),
                format!("{pointer:?} is not a JSON pointer: it must start with `/` (the whole payload cannot be ignored)"),
            ));
        }
    }
    validate_key(field, &s.key)?;
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

/// The numeric settings: retention, key size, the handler's limits, retries, breaker.
fn validate_limits(field: &str, s: &SubscriberSettings) -> Result<(), ConfigError> {
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
    Ok(())
}

/// The key source: a header name, one JSON pointer or a composite of distinct ones.
fn validate_key(field: &str, key: &KeySource) -> Result<(), ConfigError> {
    match key {
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
    Ok(())
}

/// Subscriber names become part of table names, so they are kept to a safe alphabet.
pub(crate) fn validate_subscriber_name(field: &str, name: &str) -> Result<(), ConfigError> {
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
