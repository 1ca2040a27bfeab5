//! Subscribers: the list with their stats, one subscriber (settings, stats, handler), its
//! settings (read, and changed at runtime), and its stats alone.

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use super::uploads::upload_error;
use super::{audit, blocking, check_name, known, path, ApiResult};
use crate::admin::{AdminState, ApiError, ErrorBody, HandlerInfo};
use crate::config::{
    Config, ConfigError, FingerprintSpec, KeySource, SubscriberConfig, SubscriberSettings,
};
use crate::ledger::{LedgerReport, Subscriber};
use crate::pipeline::limits_of;

/// Counters and storage figures of one subscriber.
#[derive(Debug, Serialize, Deserialize, Default, Clone, PartialEq, ToSchema)]
pub(crate) struct Stats {
    pub(crate) subscriber: String,
    pub(crate) processed: u64,
    pub(crate) duplicates: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) retries: u64,
    pub(crate) sliding_refreshes: u64,
    /// Outcomes sent after a durable commit, and the sum of their latencies (message
    /// taken in to outcome sent) in microseconds; the dashboard plots the mean of each
    /// interval.
    pub(crate) acked: u64,
    pub(crate) ack_latency_us_total: u64,
    pub(crate) claims_stored: u64,
    pub(crate) active_claims: u64,
    pub(crate) generations: u64,
    pub(crate) quarantine_stored: u64,
    pub(crate) dead_letters_stored: u64,
    pub(crate) filter_probes: u64,
    pub(crate) filter_false_positives: u64,
    pub(crate) filter_false_positive_rate: f64,
    pub(crate) filter_bytes: u64,
    pub(crate) index_bytes: u64,
    /// Bytes of the whole data directory (shards are shared by all subscribers).
    pub(crate) data_dir_bytes: u64,
}

fn stats_of(sub: &Subscriber, report: &LedgerReport) -> Stats {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &sub.counters;
    let row = report
        .subscribers
        .iter()
        .find(|r| r.subscriber == *sub.name)
        .cloned()
        .unwrap_or_default();
    let probes = c.filter_probes.load(Relaxed);
    let fps = c.filter_false_positives.load(Relaxed);
    Stats {
        subscriber: sub.name.to_string(),
        processed: c.processed.load(Relaxed),
        duplicates: c.duplicates.load(Relaxed),
        quarantined: c.quarantined.load(Relaxed),
        dead_lettered: c.dead_lettered.load(Relaxed),
        retries: c.retries.load(Relaxed),
        sliding_refreshes: c.sliding_refreshes.load(Relaxed),
        acked: c.acked.load(Relaxed),
        ack_latency_us_total: c.ack_latency_us.load(Relaxed),
        claims_stored: row.claims,
        active_claims: row.active_claims,
        generations: row.sealed_generations + u64::from(row.active_claims > 0),
        quarantine_stored: row.quarantine_records,
        dead_letters_stored: row.dead_letter_records,
        filter_probes: probes,
        filter_false_positives: fps,
        filter_false_positive_rate: if probes == 0 {
            0.0
        } else {
            fps as f64 / probes as f64
        },
        filter_bytes: row.filter_bytes,
        index_bytes: row.index_bytes,
        data_dir_bytes: report.file_bytes,
    }
}

/// `GET /v1/subscribers`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SubscriberList {
    /// By name.
    subscribers: Vec<Stats>,
}

/// `GET /v1/subscribers/{s}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SubscriberView {
    name: String,
    config: SubscriberSettings,
    stats: Stats,
    handler: HandlerInfo,
}

/// A subscriber's settings (`GET` and `PUT /v1/subscribers/{s}/config`).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ConfigView {
    subscriber: String,
    config: SubscriberSettings,
}

#[utoipa::path(get, path = "/v1/subscribers", tag = "subscribers",
    summary = "Subscribers with their counters and storage",
    responses(
        (status = 200, description = "Every subscriber the ledger knows", body = SubscriberList),
        (status = 503, description = "The engine stopped after a storage error", body = ErrorBody),
    ))]
pub(crate) async fn list_subscribers(
    State(st): State<AdminState>,
) -> ApiResult<Json<SubscriberList>> {
    let ledger = st.ledger().clone();
    blocking(move || {
        let report = ledger.report()?;
        let mut subs = ledger.subscribers();
        subs.sort_by(|a, b| a.name.cmp(&b.name));
        let list: Vec<Stats> = subs.iter().map(|s| stats_of(s, &report)).collect();
        Ok(Json(SubscriberList { subscribers: list }))
    })
    .await
}

#[utoipa::path(get, path = "/v1/subscribers/{s}", tag = "subscribers",
    summary = "One subscriber: config, stats, handler",
    params(("s" = String, Path, description = "Subscriber name")),
    responses(
        (status = 200, description = "The subscriber", body = SubscriberView),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn get_subscriber(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<SubscriberView>> {
    let name = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    let handler = st.0.uploads.info(&ledger, &name);
    blocking(move || {
        let report = ledger.report()?;
        Ok(Json(SubscriberView {
            name: sub.name.to_string(),
            config: (*sub.settings()).clone(),
            stats: stats_of(&sub, &report),
            handler,
        }))
    })
    .await
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/config", tag = "subscribers",
    summary = "A subscriber's settings",
    params(("s" = String, Path, description = "Subscriber name")),
    responses(
        (status = 200, description = "The settings in force", body = ConfigView),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn get_config(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<ConfigView>> {
    let name = path(p)?;
    let sub = known(st.ledger(), &name)?;
    let config = (*sub.settings()).clone();
    Ok(Json(ConfigView {
        subscriber: name,
        config,
    }))
}

/// The body of `PUT /v1/subscribers/{s}/config`: the settings that can change at runtime,
/// each optional (left out: keeps its value). Its own type rather than [`SubscriberConfig`]
/// so that the documented schema admits exactly what the route takes: `name` comes from the
/// path, `handler` from an upload and `partition_key` is fixed by the on-disk layout. Any
/// other field is refused (`additionalProperties: false`).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConfigChange {
    /// How long a claim is remembered (`24h`, `7days`).
    #[serde(default, with = "humantime_serde")]
    #[schema(value_type = Option<String>)]
    ttl: Option<Duration>,
    /// Refresh a claim's expiry each time a duplicate arrives.
    #[serde(default)]
    sliding_ttl: Option<bool>,
    /// Where the idempotency key comes from; refused (409) while claims made with another live.
    #[serde(default)]
    key: Option<KeySource>,
    /// Keys longer than this are rejected.
    #[serde(default)]
    max_key_bytes: Option<usize>,
    /// Budget of one handler call (`10ms`).
    #[serde(default, with = "humantime_serde")]
    #[schema(value_type = Option<String>)]
    handler_cpu_budget: Option<Duration>,
    /// Cap of a handler instance's linear memories, in MiB.
    #[serde(default)]
    handler_memory_mib: Option<usize>,
    /// State writes one handler call may make.
    #[serde(default)]
    handler_max_writes: Option<usize>,
    /// MiB of state and outbox messages one handler call may write.
    #[serde(default)]
    handler_max_write_mib: Option<usize>,
    /// Attempts before a failing message is dead-lettered.
    #[serde(default)]
    max_attempts: Option<u32>,
    /// Delay before the second attempt (`50ms`); doubles for each further one.
    #[serde(default, with = "humantime_serde")]
    #[schema(value_type = Option<String>)]
    retry_backoff: Option<Duration>,
    /// Longest delay between two attempts (`60s`).
    #[serde(default, with = "humantime_serde")]
    #[schema(value_type = Option<String>)]
    max_backoff: Option<Duration>,
    /// Sandbox failures in a row that open the handler's circuit breaker (0: never).
    #[serde(default)]
    handler_breaker_failures: Option<u32>,
    /// How long an open breaker refuses calls (`5s`).
    #[serde(default, with = "humantime_serde")]
    #[schema(value_type = Option<String>)]
    handler_breaker_cooldown: Option<Duration>,
    /// What of a JSON payload the fingerprint covers.
    #[serde(default)]
    fingerprint: Option<FingerprintSpec>,
}

impl ConfigChange {
    /// These settings for subscriber `name`, as a config file would give them. Every field
    /// is named (no `..`): a setting added to [`SubscriberConfig`] does not compile here
    /// until it is decided whether the API may change it.
    fn into_config(self, name: &str) -> SubscriberConfig {
        SubscriberConfig {
            name: name.to_string(),
            ttl: self.ttl,
            sliding_ttl: self.sliding_ttl,
            key: self.key,
            max_key_bytes: self.max_key_bytes,
            partition_key: None,
            handler: None,
            handler_cpu_budget: self.handler_cpu_budget,
            handler_memory_mib: self.handler_memory_mib,
            handler_max_writes: self.handler_max_writes,
            handler_max_write_mib: self.handler_max_write_mib,
            max_attempts: self.max_attempts,
            retry_backoff: self.retry_backoff,
            max_backoff: self.max_backoff,
            handler_breaker_failures: self.handler_breaker_failures,
            handler_breaker_cooldown: self.handler_breaker_cooldown,
            fingerprint: self.fingerprint,
        }
    }
}

/// The first field of `obj` that does not parse on its own, with serde's reason.
fn failing_field(obj: &Map<String, Value>) -> Option<(String, String)> {
    for (k, v) in obj {
        let mut one = serde_json::Map::new();
        one.insert(k.clone(), v.clone());
        if let Err(e) = serde_json::from_value::<ConfigChange>(Value::Object(one)) {
            return Some((k.clone(), e.to_string()));
        }
    }
    None
}

/// Merges the given fields over the subscriber's settings, validates them as the config
/// loader would, and installs them; shards pick them up between batches.
#[utoipa::path(put, path = "/v1/subscribers/{s}/config", tag = "subscribers",
    summary = "Change settings; fields left out keep their value; a 400 names the field",
    description = "Takes ttl, sliding_ttl, key, max_key_bytes, the handler limits, the retry policy and fingerprint. `name` (taken from the path), `handler` (uploaded: PUT /v1/subscribers/{s}/handler) and `partition_key` (part of the on-disk layout) are refused.",
    params(("s" = String, Path, description = "Subscriber name; an unknown one is registered (up to ledger.max_implicit_subscribers)")),
    request_body(content = ConfigChange, description = "The settings to change"),
    responses(
        (status = 200, description = "The settings now in force", body = ConfigView),
        (status = 400, description = "A field that does not parse or is refused; `field` names it", body = ErrorBody),
        (status = 403, description = "Past ledger.max_implicit_subscribers", body = ErrorBody),
        (status = 409, description = "Another key source while the subscriber has live claims", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn put_config(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    b: Result<Json<Value>, JsonRejection>,
) -> ApiResult<Json<ConfigView>> {
    let name = path(p)?;
    check_name(&name)?;
    let Json(given) = b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge {
                limit: st.0.http.max_body_bytes,
            }
        } else {
            ApiError::bad("body", e.body_text())
        }
    })?;
    let Value::Object(obj) = given else {
        return Err(ApiError::bad("body", "must be a JSON object of settings"));
    };
    let patch = settings_patch(&name, &obj)?;
    let ledger = st.ledger().clone();
    // Checked before the subscriber is registered: a refused change uses up no implicit
    // subscriber.
    let settings = patch.resolve(&*ledger.settings_of(&name)?);
    check_settings(&settings)?;
    let sub = ledger.subscriber(&name)?;
    let st2 = st.clone();
    let name2 = name.clone();
    let changed: Vec<String> = obj.keys().cloned().collect();
    let before = sub.settings();
    let limits_changed = limits_of(&before) != limits_of(&settings);
    blocking(move || {
        // All or nothing: a handler instance carries its limits, so with new ones it is
        // loaded first; the settings change only once that worked, and go back if it
        // cannot be installed.
        let handler = match limits_changed {
            true => st2
                .0
                .uploads
                .load_under(&name2, &settings)
                .map_err(upload_error)?,
            false => None,
        };
        ledger.update_settings(&name2, settings)?;
        if let Some(handler) = handler {
            if let Err(e) = ledger.set_handler(&name2, Some(handler)) {
                ledger.update_settings(&name2, (*before).clone())?;
                return Err(e.into());
            }
        }
        audit(
            &st2,
            "config.update",
            Some(&name2),
            json!({"fields": changed}),
        )?;
        Ok(())
    })
    .await?;
    let sub = known(st.ledger(), &name)?;
    let config = (*sub.settings()).clone();
    Ok(Json(ConfigView {
        subscriber: name,
        config,
    }))
}

/// The settings `obj` gives for subscriber `name`: not the fields fixed elsewhere, each
/// field parsing on its own (so a 400 names the first one that does not).
fn settings_patch(name: &str, obj: &Map<String, Value>) -> ApiResult<SubscriberConfig> {
    for (field, why) in [
        ("name", "is taken from the path"),
        (
            "handler",
            "is set by uploading a component: PUT /v1/subscribers/{s}/handler",
        ),
        (
            "partition_key",
            "is part of the on-disk layout and cannot change at runtime",
        ),
    ] {
        if obj.contains_key(field) {
            return Err(ApiError::bad(field, format!("`{field}` {why}")));
        }
    }
    if let Some((field, why)) = failing_field(obj) {
        return Err(ApiError::bad(field, why));
    }
    let change: ConfigChange = serde_json::from_value(Value::Object(obj.clone()))
        .map_err(|e| ApiError::bad("body", e.to_string()))?;
    Ok(change.into_config(name))
}

/// Checks merged settings as the config loader checks `[defaults]`; a 400 names the field.
fn check_settings(settings: &SubscriberSettings) -> ApiResult<()> {
    let check = Config {
        defaults: settings.clone(),
        ..Config::default()
    };
    check.validate().map_err(|e| match e {
        ConfigError::Invalid { field, problem } => {
            let field = field
                .strip_prefix("defaults.")
                .unwrap_or(&field)
                .to_string();
            ApiError::bad(field.clone(), format!("`{field}` {problem}"))
        }
        other => ApiError::bad("body", other.to_string()),
    })
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/stats", tag = "subscribers",
    summary = "Processed, duplicates, quarantined, dead-lettered, claims stored, generations, filter false-positive rate, bytes",
    params(("s" = String, Path, description = "Subscriber name")),
    responses(
        (status = 200, description = "The subscriber's figures", body = Stats),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn get_stats(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Stats>> {
    let name = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    blocking(move || {
        let report = ledger.report()?;
        Ok(Json(stats_of(&sub, &report)))
    })
    .await
}
