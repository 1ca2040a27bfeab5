//! Route handlers. Each one maps its failures to [`ApiError`]; ledger calls that wait for
//! a shard or the disk run on the blocking pool.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::handlers::UploadError;
use super::ingest::StartError;
use super::{Access, AdminState, ApiError, Authorized};
use crate::config::{validate_subscriber_name, Config, ConfigError, KeySource, SubscriberConfig};
use crate::envelope::IdempotencyKey;
use crate::ledger::{Ledger, Outcome, RecordKind, StoredRecord, Subscriber};
use crate::pipeline::limits_of;
use crate::source::delivery::{envelope, Delivery, EnvelopeError, Keying, Payload, Routed, Target};

type ApiResult<T> = Result<T, ApiError>;

/// The request header carrying the idempotency key (IETF draft `Idempotency-Key`).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on a response that replays the stored outcome of an earlier request.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Request headers that are not part of the message.
const NOT_MESSAGE_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "host",
    "connection",
    "keep-alive",
    "content-length",
    "transfer-encoding",
    "accept",
    "accept-encoding",
    "user-agent",
    IDEMPOTENCY_KEY,
];

/// Optional request header with the partition key, for subscribers that route by it.
pub const PARTITION_KEY: &str = "partition-key";

fn path<T>(p: Result<Path<T>, PathRejection>) -> ApiResult<T> {
    p.map(|Path(t)| t)
        .map_err(|e| ApiError::bad("path", format!("bad path parameter: {}", e.body_text())))
}

fn body(b: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            // The caller knows which limit applied and fills it in.
            ApiError::TooLarge { limit: 0 }
        } else {
            ApiError::bad("body", e.body_text())
        }
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("blocking task failed: {e}")))?
}

fn check_name(name: &str) -> ApiResult<()> {
    // "." and ".." pass the ledger's alphabet but are directory names on disk.
    if name.bytes().all(|b| b == b'.') {
        return Err(ApiError::bad(
            "subscriber",
            format!("{name:?} is not a usable subscriber name"),
        ));
    }
    validate_subscriber_name("subscriber", name).map_err(|_| {
        ApiError::bad(
            "subscriber",
            format!("{name:?} is not a valid subscriber name (1-64 of A-Z a-z 0-9 . _ -)"),
        )
    })
}

/// A subscriber the ledger knows (configured, on disk or seen in traffic); reads never
/// register new ones.
fn known(ledger: &Ledger, name: &str) -> ApiResult<Arc<Subscriber>> {
    check_name(name)?;
    ledger
        .subscribers()
        .into_iter()
        .find(|s| &*s.name == name)
        .ok_or_else(|| ApiError::NotFound(format!("no subscriber {name:?}")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn audit(st: &AdminState, action: &str, subscriber: Option<&str>, detail: Value) -> ApiResult<()> {
    st.0.audit
        .record(action, subscriber, detail)
        .map_err(|e| ApiError::Internal(format!("cannot write the audit log: {e}")))
}

// ---------------------------------------------------------------------------------------
// health, dashboard, openapi, fallback

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(st): State<AdminState>) -> ApiResult<Json<Value>> {
    // Ledger::open returns only after filters are loaded and logs replayed (I5); what can
    // change afterwards is a storage error (I4).
    if let Some(reason) = st.ledger().poison_reason() {
        tracing::warn!(%reason, "readyz: the ledger is stopped");
        return Err(ApiError::Unavailable(
            "the engine stopped after a storage error; see its log".into(),
        ));
    }
    Ok(Json(json!({
        "status": "ready",
        "shards": st.ledger().shard_count(),
        "subscribers": st.ledger().subscribers().len(),
    })))
}

pub async fn dashboard_html() -> Html<&'static str> {
    Html(include_str!("assets/index.html"))
}

pub async fn dashboard_js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("assets/app.js"),
    )
}

pub async fn dashboard_css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("assets/app.css"),
    )
}

pub async fn openapi_json() -> Json<Value> {
    Json(super::openapi())
}

/// 405 with a JSON body, like every other error.
pub async fn wrong_method(method: Method, uri: Uri) -> Response {
    let body = json!({
        "error": "method_not_allowed",
        "message": format!("{} does not take {method}; /openapi.json lists its methods", uri.path()),
    });
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

pub async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!(
        "no route {method} {}; /openapi.json lists them",
        uri.path()
    ))
}

// ---------------------------------------------------------------------------------------
// subscribers, config, stats

/// Counters and storage figures of one subscriber.
#[derive(Debug, Serialize, Deserialize, Default, Clone, PartialEq)]
pub struct Stats {
    pub subscriber: String,
    pub processed: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    pub dead_lettered: u64,
    pub retries: u64,
    pub sliding_refreshes: u64,
    pub claims_stored: u64,
    pub active_claims: u64,
    pub generations: u64,
    pub quarantine_stored: u64,
    pub dead_letters_stored: u64,
    pub filter_probes: u64,
    pub filter_false_positives: u64,
    pub filter_false_positive_rate: f64,
    pub filter_bytes: u64,
    pub index_bytes: u64,
    /// Bytes of the whole data directory (shards are shared by all subscribers).
    pub data_dir_bytes: u64,
}

fn stats_of(sub: &Subscriber, report: &crate::ledger::LedgerReport) -> Stats {
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

pub async fn list_subscribers(State(st): State<AdminState>) -> ApiResult<Json<Value>> {
    let ledger = st.ledger().clone();
    blocking(move || {
        let report = ledger.report()?;
        let mut subs = ledger.subscribers();
        subs.sort_by(|a, b| a.name.cmp(&b.name));
        let list: Vec<Stats> = subs.iter().map(|s| stats_of(s, &report)).collect();
        Ok(Json(json!({"subscribers": list})))
    })
    .await
}

pub async fn get_subscriber(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let name = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    let handler = st.0.handlers.info(&ledger, &name);
    blocking(move || {
        let report = ledger.report()?;
        Ok(Json(json!({
            "name": &*sub.name,
            "config": &*sub.settings(),
            "stats": stats_of(&sub, &report),
            "handler": handler,
        })))
    })
    .await
}

pub async fn get_config(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let name = path(p)?;
    let sub = known(st.ledger(), &name)?;
    let settings = sub.settings();
    Ok(Json(json!({"subscriber": name, "config": &*settings})))
}

/// The first field of `obj` that does not parse on its own, with serde's reason.
fn failing_field(name: &str, obj: &serde_json::Map<String, Value>) -> Option<(String, String)> {
    for (k, v) in obj {
        let mut one = serde_json::Map::new();
        one.insert("name".into(), Value::String(name.into()));
        one.insert(k.clone(), v.clone());
        if let Err(e) = serde_json::from_value::<SubscriberConfig>(Value::Object(one)) {
            return Some((k.clone(), e.to_string()));
        }
    }
    None
}

/// Merges the given fields over the subscriber's settings, validates them as the config
/// loader would, and installs them; shards pick them up between batches.
pub async fn put_config(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    b: Result<Json<Value>, JsonRejection>,
) -> ApiResult<Json<Value>> {
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
    if let Some((field, why)) = failing_field(&name, &obj) {
        return Err(ApiError::bad(field, why));
    }
    let mut with_name = obj.clone();
    with_name.insert("name".into(), Value::String(name.clone()));
    let patch: SubscriberConfig = serde_json::from_value(Value::Object(with_name))
        .map_err(|e| ApiError::bad("body", e.to_string()))?;
    let ledger = st.ledger().clone();
    let sub = ledger.subscriber(&name)?;
    let settings = patch.resolve(&sub.settings());
    let check = Config {
        defaults: settings.clone(),
        ..Config::default()
    };
    if let Err(e) = check.validate() {
        return Err(match e {
            ConfigError::Invalid { field, problem } => {
                let field = field
                    .strip_prefix("defaults.")
                    .unwrap_or(&field)
                    .to_string();
                ApiError::bad(field.clone(), format!("`{field}` {problem}"))
            }
            other => ApiError::bad("body", other.to_string()),
        });
    }
    let st2 = st.clone();
    let name2 = name.clone();
    let changed: Vec<String> = obj.keys().cloned().collect();
    let limits_changed = limits_of(&sub.settings()) != limits_of(&settings);
    blocking(move || {
        ledger.update_settings(&name2, settings)?;
        // A handler instance carries its limits: reload it so new ones take effect.
        if limits_changed {
            st2.0
                .handlers
                .reinstall(&ledger, &name2)
                .map_err(upload_error)?;
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
    Ok(Json(
        json!({"subscriber": name, "config": &*sub.settings()}),
    ))
}

pub async fn get_stats(
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

// ---------------------------------------------------------------------------------------
// claims

fn claim_key(sub: &Subscriber, id: &str) -> ApiResult<u128> {
    if id.is_empty() {
        return Err(ApiError::bad("id", "the message id is empty"));
    }
    if id.len() > sub.settings().max_key_bytes {
        return Err(ApiError::bad(
            "id",
            format!(
                "the message id is longer than {} bytes",
                sub.settings().max_key_bytes
            ),
        ));
    }
    Ok(IdempotencyKey::from_id(id).hash)
}

/// The live claim of a message id. Without the token (when one is configured) the payload
/// fingerprint is left out: it is unkeyed, so it would let anyone confirm a guessed payload.
pub async fn get_claim(
    access: Access,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let (name, id) = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    let key = claim_key(&sub, &id)?;
    let claim = blocking(move || Ok(ledger.lookup(&name, key)?)).await?;
    match claim {
        Some(c) if c.is_live(now_ms()) => {
            let mut shown = json!({
                "subscriber": &*sub.name,
                "id": id,
                "processed_at_ms": c.processed_at_ms,
                "expires_at_ms": c.expires_at_ms,
                "fingerprint": format!("{:016x}", c.fingerprint),
                "handler_version": format!("{:016x}", c.handler_version),
            });
            if access == Access::Redacted {
                redact(&mut shown, &["fingerprint"]);
            }
            Ok(Json(shown))
        }
        _ => Err(ApiError::NotFound(format!("no live claim for {id:?}"))),
    }
}

pub async fn forget_claim(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let (name, id) = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    let key = claim_key(&sub, &id)?;
    let st2 = st.clone();
    let id2 = id.clone();
    let forgot = blocking(move || {
        let forgot = ledger.forget(&name, key)?;
        if forgot {
            audit(&st2, "claim.forget", Some(&name), json!({"id": id2}))?;
        }
        Ok(forgot)
    })
    .await?;
    if forgot {
        Ok(Json(
            json!({"subscriber": &*sub.name, "id": id, "forgotten": true}),
        ))
    } else {
        Err(ApiError::NotFound(format!("no live claim for {id:?}")))
    }
}

// ---------------------------------------------------------------------------------------
// ingest

/// What a processed message's response says; a replay repeats it from the claim.
#[derive(Debug, Serialize)]
struct Processed<'a> {
    subscriber: &'a str,
    key: &'a str,
    outcome: &'static str,
    fingerprint: String,
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> ApiResult<Option<&'a str>> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::bad(name, format!("header `{name}` must be visible ASCII"))),
    }
}

/// Whether `Content-Type` promises JSON: absent, `application/json` or `application/*+json`.
fn promises_json(headers: &HeaderMap) -> bool {
    match super::guard::media_type(headers) {
        None => true,
        Some(t) => {
            t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
        }
    }
}

/// The body as JSON when it is JSON. A body whose content type promises JSON (or that
/// names none) must parse, so a client's broken JSON is a 400 instead of being stored as
/// opaque bytes; under any other type a body that does not parse is an opaque payload.
fn payload_json(headers: &HeaderMap, body: &[u8]) -> ApiResult<Option<Value>> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(Some(v)),
        Err(e) if promises_json(headers) => Err(ApiError::bad(
            "body",
            format!("the body is not valid JSON ({e}); send JSON, or a non-JSON payload under its own Content-Type (application/octet-stream, say)"),
        )),
        Err(_) => Ok(None),
    }
}

/// `POST /v1/subscribers/{s}/messages`: the body is the payload. The key is the
/// `Idempotency-Key` header, or (without it) whatever the subscriber's key source names in
/// the body. Answers once the outcome is durable.
pub async fn ingest_message(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let started = std::time::Instant::now();
    let name = path(p)?;
    let body = body(b).map_err(|e| match e {
        ApiError::TooLarge { .. } => ApiError::TooLarge {
            limit: st.0.http.max_body_bytes,
        },
        other => other,
    })?;
    check_name(&name)?;
    let ledger = st.ledger();
    let sub = ledger.subscriber(&name)?;
    let settings = sub.settings();
    let json_body = payload_json(&headers, &body)?;
    let given = header_str(&headers, IDEMPOTENCY_KEY)?;
    let id = json_body
        .as_ref()
        .and_then(|v| v.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let key = header_str(&headers, PARTITION_KEY)?.map(str::to_string);
    let is_json = json_body.is_some();
    let payload = match json_body {
        Some(v) => Payload::Json(v),
        None => Payload::Opaque(body.to_vec()),
    };
    // HTTP header names are case-insensitive; the delivery holds them lowercased.
    let mut message_headers = BTreeMap::new();
    for (k, v) in &headers {
        // Credentials and transport headers are not message headers: they never reach a
        // handler or a dead-letter record.
        if NOT_MESSAGE_HEADERS.contains(&k.as_str()) {
            continue;
        }
        if let Ok(v) = v.to_str() {
            message_headers.insert(k.as_str().to_string(), v.to_string());
        }
    }
    let delivery = Delivery {
        id,
        key,
        headers: message_headers.into_iter().collect(),
        lowercase_header_names: true,
        origin: Some("http".into()),
        received_at_ms: now_ms(),
        ..Delivery::new(Target::Resolved(sub.clone()), payload)
    };
    let given = match given {
        Some(k) => {
            let k = k.trim();
            if k.is_empty() {
                return Err(ApiError::bad(
                    IDEMPOTENCY_KEY,
                    "the `Idempotency-Key` header is empty",
                ));
            }
            if k.len() > settings.max_key_bytes {
                return Err(ApiError::bad(
                    IDEMPOTENCY_KEY,
                    format!(
                        "the `Idempotency-Key` header is longer than {} bytes",
                        settings.max_key_bytes
                    ),
                ));
            }
            Some(IdempotencyKey::from_id(k))
        }
        None => {
            let usable = is_json
                || matches!(
                    settings.key,
                    KeySource::ContentHash | KeySource::Header { .. }
                );
            if !usable {
                return Err(ApiError::bad(
                    IDEMPOTENCY_KEY,
                    "missing idempotency key: send an `Idempotency-Key` header",
                ));
            }
            None
        }
    };
    let keying = match &given {
        Some(k) => Keying::Given(k),
        None => Keying::Derive,
    };
    let ingest = st.ingest();
    let Routed { mut job, shard, .. } = envelope(ledger, delivery, keying, ingest.ack_sender())
        .map_err(|e| match e {
            EnvelopeError::Key { error, .. } => ApiError::bad(
                IDEMPOTENCY_KEY,
                format!("missing idempotency key: send an `Idempotency-Key` header ({error})"),
            ),
            EnvelopeError::Entity { error, .. } => ApiError::bad(PARTITION_KEY, error.to_string()),
            EnvelopeError::Subscriber(e) => e.into(),
        })?;
    let key = IdempotencyKey {
        text: job.id.to_string(),
        hash: job.key,
    };
    let fp = job.fingerprint;
    let (seq, outcome) = match ingest.register(Some((sub.id, key.hash))) {
        Ok(r) => r,
        Err(StartError::InFlight) => {
            return Err(ApiError::Conflict(
                "a request with this Idempotency-Key is still being processed; retry later".into(),
            ))
        }
        Err(StartError::Stopped) => return Err(ApiError::Unavailable("shutting down".into())),
    };
    job.seq = seq;
    ingest
        .send(shard, job)
        .map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    let outcome = outcome
        .await
        .map_err(|_| ApiError::Unavailable("the engine stopped before deciding".into()))?;
    super::metrics::observe_ingest(outcome.name(), started.elapsed().as_secs_f64());
    let reply = Processed {
        subscriber: &sub.name,
        key: &key.text,
        outcome: "processed",
        fingerprint: format!("{fp:016x}"),
    };
    match outcome {
        Outcome::Processed => Ok((StatusCode::CREATED, Json(reply)).into_response()),
        Outcome::Duplicate => {
            // Same key, same fingerprint: the stored response again (IETF draft, Stripe).
            let mut resp = (StatusCode::CREATED, Json(reply)).into_response();
            resp.headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            Ok(resp)
        }
        Outcome::Quarantined { stored_fingerprint } => Err(ApiError::Unprocessable(format!(
            "Idempotency-Key {:?} was used before with another payload (stored fingerprint {stored_fingerprint:016x}, this one {fp:016x}); the request is quarantined",
            key.text
        ))),
        Outcome::DeadLettered { .. } => Err(ApiError::HandlerFailed(
            "the handler failed and the message was dead-lettered; see GET /v1/subscribers/{s}/deadletters".into(),
        )),
        Outcome::Rejected { reason } => Err(ApiError::bad("body", reason)),
        Outcome::Failed { reason } => {
            tracing::error!(%reason, "ingest: the ledger failed");
            Err(ApiError::Unavailable(
                "the engine stopped after a storage error; nothing was acknowledged".into(),
            ))
        }
    }
}

// ---------------------------------------------------------------------------------------
// quarantine and dead letters

#[derive(Debug, Deserialize)]
pub struct Page {
    after: Option<String>,
    limit: Option<usize>,
}

/// Fields of a listed record that can quote or confirm a payload: handler failure reasons
/// (often the offending field), fingerprints (unkeyed hashes of the payload) and the
/// partition key (often a payload field).
const PAYLOAD_REVEALING: &[&str] = &["reason", "fingerprint", "stored_fingerprint", "key"];

/// Removes `fields` from `v` and says so in `redacted`, so a reader knows to send the token.
fn redact(v: &mut Value, fields: &[&str]) {
    if let Some(o) = v.as_object_mut() {
        for f in fields {
            o.remove(*f);
        }
        o.insert(
            "redacted".into(),
            json!({"fields": fields, "why": "send the bearer token to see them"}),
        );
    }
}

/// A record as the API shows it: `id` is the record id; the message's own id is
/// `message_id`.
fn shown(r: &StoredRecord, with_payload: bool) -> Value {
    let mut v = r.body.clone();
    if let Some(o) = v.as_object_mut() {
        if let Some(message_id) = o.remove("id") {
            o.insert("message_id".into(), message_id);
        }
        if !with_payload {
            for k in ["payload", "payload_base64", "headers"] {
                o.remove(k);
            }
        }
        o.insert("id".into(), Value::String(r.id.clone()));
        o.insert("kind".into(), Value::String(r.kind.name().into()));
    }
    v
}

async fn list_records(
    st: AdminState,
    access: Access,
    kind: RecordKind,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<Page>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let name = path(p)?;
    let Query(page) = q.map_err(|e| ApiError::bad("query", e.body_text()))?;
    let limit = page.limit.unwrap_or(50);
    if limit == 0 || limit > 1000 {
        return Err(ApiError::bad("limit", "`limit` must be between 1 and 1000"));
    }
    let ledger = st.ledger().clone();
    known(&ledger, &name)?;
    blocking(move || {
        let rows = ledger.records(kind, &name, page.after.as_deref(), limit)?;
        let next = (rows.len() == limit)
            .then(|| rows.last().map(|r| r.id.clone()))
            .flatten();
        let records: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut v = shown(r, false);
                if access == Access::Redacted {
                    redact(&mut v, PAYLOAD_REVEALING);
                }
                v
            })
            .collect();
        Ok(Json(
            json!({"subscriber": name, "records": records, "next": next}),
        ))
    })
    .await
}

async fn get_record(
    st: AdminState,
    kind: RecordKind,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let (name, rid) = path(p)?;
    let ledger = st.ledger().clone();
    known(&ledger, &name)?;
    blocking(move || match ledger.record(kind, &name, &rid)? {
        Some(r) => Ok(Json(shown(&r, true))),
        None => Err(ApiError::NotFound(format!("no record {rid:?}"))),
    })
    .await
}

async fn discard_record(
    st: AdminState,
    kind: RecordKind,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let (name, rid) = path(p)?;
    let ledger = st.ledger().clone();
    known(&ledger, &name)?;
    blocking(move || {
        if !ledger.discard_record(kind, &name, &rid)? {
            return Err(ApiError::NotFound(format!("no record {rid:?}")));
        }
        audit(
            &st,
            "record.discard",
            Some(&name),
            json!({"kind": kind, "record": rid}),
        )?;
        Ok(Json(
            json!({"subscriber": name, "record": rid, "discarded": true}),
        ))
    })
    .await
}

async fn replay_record(
    st: AdminState,
    kind: RecordKind,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let (name, rid) = path(p)?;
    let ledger = st.ledger().clone();
    known(&ledger, &name)?;
    let (seq, outcome) = st
        .ingest()
        .register(None)
        .map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    let ack = st.ingest().ack_sender();
    let st2 = st.clone();
    let (name2, rid2) = (name.clone(), rid.clone());
    let started = blocking(move || Ok(ledger.replay(kind, &name2, &rid2, seq, ack)?)).await;
    match started {
        Ok(true) => {}
        Ok(false) => {
            st.ingest().unregister(seq);
            return Err(ApiError::NotFound(format!("no record {rid:?}")));
        }
        Err(e) => {
            st.ingest().unregister(seq);
            return Err(e);
        }
    }
    let outcome = outcome
        .await
        .map_err(|_| ApiError::Unavailable("the engine stopped before deciding".into()))?;
    if let Outcome::Failed { .. } = outcome {
        return Err(ApiError::Unavailable(
            "the engine stopped after a storage error; see its log".into(),
        ));
    }
    let detail = json!({"kind": kind, "record": rid, "outcome": outcome.name()});
    let name3 = name.clone();
    blocking(move || audit(&st2, "record.replay", Some(&name3), detail)).await?;
    Ok(Json(json!({
        "subscriber": name,
        "record": rid,
        "outcome": outcome.name(),
        "reason": outcome.reason(),
    })))
}

pub async fn list_quarantine(
    access: Access,
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<Page>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    list_records(st, access, RecordKind::Quarantine, p, q).await
}

pub async fn list_deadletters(
    access: Access,
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<Page>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    list_records(st, access, RecordKind::DeadLetter, p, q).await
}

pub async fn get_quarantine(
    _auth: Authorized,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    get_record(st, RecordKind::Quarantine, p).await
}

pub async fn get_deadletter(
    _auth: Authorized,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    get_record(st, RecordKind::DeadLetter, p).await
}

pub async fn discard_quarantine(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    discard_record(st, RecordKind::Quarantine, p).await
}

pub async fn discard_deadletter(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    discard_record(st, RecordKind::DeadLetter, p).await
}

pub async fn replay_quarantine(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    replay_record(st, RecordKind::Quarantine, p).await
}

pub async fn replay_deadletter(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    replay_record(st, RecordKind::DeadLetter, p).await
}

// ---------------------------------------------------------------------------------------
// handlers

pub async fn get_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<super::HandlerInfo>> {
    let name = path(p)?;
    known(st.ledger(), &name)?;
    Ok(Json(st.0.handlers.info(st.ledger(), &name)))
}

fn upload_error(e: UploadError) -> ApiError {
    match e {
        UploadError::Invalid(h) => ApiError::bad("body", h.to_string()),
        UploadError::NoPrevious => ApiError::NotFound("no previous handler to roll back to".into()),
        UploadError::Ledger(l) => l.into(),
        UploadError::Io(io) => ApiError::Internal(io.to_string()),
    }
}

pub async fn upload_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    b: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<super::HandlerInfo>> {
    let name = path(p)?;
    check_name(&name)?;
    let bytes = body(b).map_err(|e| match e {
        ApiError::TooLarge { .. } => ApiError::TooLarge {
            limit: st.0.http.max_handler_bytes,
        },
        other => other,
    })?;
    if bytes.is_empty() {
        return Err(ApiError::bad(
            "body",
            "the body must be a WebAssembly component",
        ));
    }
    blocking(move || {
        let info =
            st.0.handlers
                .upload(st.ledger(), &name, &bytes)
                .map_err(upload_error)?;
        audit(
            &st,
            "handler.upload",
            Some(&name),
            json!({"version": info.current, "bytes": bytes.len()}),
        )?;
        Ok(Json(info))
    })
    .await
}

pub async fn rollback_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<super::HandlerInfo>> {
    let name = path(p)?;
    known(st.ledger(), &name)?;
    blocking(move || {
        let info =
            st.0.handlers
                .rollback(st.ledger(), &name)
                .map_err(upload_error)?;
        audit(
            &st,
            "handler.rollback",
            Some(&name),
            json!({"version": info.current}),
        )?;
        Ok(Json(info))
    })
    .await
}

// ---------------------------------------------------------------------------------------
// maintenance and audit

#[derive(Debug, Deserialize)]
pub struct CompactQuery {
    #[serde(default)]
    seal_all: bool,
}

pub async fn compact(
    State(st): State<AdminState>,
    q: Result<Query<CompactQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = q.map_err(|e| ApiError::bad("seal_all", e.body_text()))?;
    blocking(move || {
        let started = std::time::Instant::now();
        st.ledger().maintain(q.seal_all)?;
        let ms = started.elapsed().as_millis() as u64;
        audit(
            &st,
            "maintenance.compact",
            None,
            json!({"seal_all": q.seal_all, "ms": ms}),
        )?;
        Ok(Json(
            json!({"compacted": true, "seal_all": q.seal_all, "ms": ms}),
        ))
    })
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupRequest {
    /// Directory name inside the backup directory: `[A-Za-z0-9._-]`, not `.` or `..`.
    name: String,
}

pub async fn backup(
    State(st): State<AdminState>,
    b: Result<Json<BackupRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Json(req) = b.map_err(|e| ApiError::bad("name", e.body_text()))?;
    let ok = !req.name.is_empty()
        && req.name.len() <= 128
        && req.name != "."
        && req.name != ".."
        && req
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::bad(
            "name",
            "`name` must be 1-128 of A-Z a-z 0-9 . _ - (a directory inside the backup directory)",
        ));
    }
    let root =
        st.0.http
            .backup_dir
            .clone()
            .unwrap_or_else(|| st.ledger().data_dir().join("backups"));
    let dir = root.join(&req.name);
    if dir.exists() {
        return Err(ApiError::Exists(format!(
            "backup {:?} exists already",
            req.name
        )));
    }
    blocking(move || {
        std::fs::create_dir_all(&root)
            .map_err(|e| ApiError::Internal(format!("cannot create {}: {e}", root.display())))?;
        let bytes = st.ledger().backup(&dir)?;
        audit(
            &st,
            "maintenance.backup",
            None,
            json!({"name": req.name, "bytes": bytes}),
        )?;
        Ok(Json(json!({"name": req.name, "bytes": bytes})))
    })
    .await
}

#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    limit: Option<usize>,
}

pub async fn audit_log(
    _auth: Authorized,
    State(st): State<AdminState>,
    q: Result<Query<AuditQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = q.map_err(|e| ApiError::bad("limit", e.body_text()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 10_000);
    blocking(move || {
        let entries =
            st.0.audit
                .tail(limit)
                .map_err(|e| ApiError::Internal(format!("cannot read the audit log: {e}")))?;
        Ok(Json(json!({"entries": entries})))
    })
    .await
}
