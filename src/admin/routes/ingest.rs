//! `POST /v1/subscribers/{s}/messages`: the HTTP source's route. It takes the request
//! apart for [`crate::source::http`] (which reads it as a delivery), routes the delivery
//! with [`delivery::route`], waits for the durable outcome through [`crate::admin::bridge`], and
//! answers with `Idempotency-Key` semantics: 201 once processed, the same 201 with
//! `Idempotent-Replayed: true` for a duplicate, 409 while the same key is in flight (or,
//! with `Prefer: wait=N`, a bounded wait for it to be decided, then the answer a retry
//! gets), 422 for the key reused with another payload.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::{body, check_name, now_ms, path, ApiResult, BinaryBody};
use crate::admin::bridge::StartError;
use crate::admin::{guard, metrics, AdminState, ApiError, ErrorBody};
use crate::config::SubscriberSettings;
use crate::envelope::IdempotencyKey;
use crate::ledger::{Job, Outcome, Subscriber};
use crate::source::delivery::{self, key_delivery, Delivery, RouteError, Routed, Target};
use crate::source::http::{self, Message, IDEMPOTENCY_KEY, PARTITION_KEY};

/// Set on a response that replays the stored outcome of an earlier request.
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// What a processed message's response says; a replay repeats it from the claim.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Processed<'a> {
    subscriber: &'a str,
    /// The idempotency key's text.
    key: &'a str,
    /// Always `processed` (a replay says so too: it repeats the first answer).
    outcome: &'static str,
    /// xxh3-64 of the payload (as the subscriber's fingerprint spec covers it), 16 hex
    /// digits.
    fingerprint: String,
}

/// `POST /v1/subscribers/{s}/messages`: the body is the payload. The key is the
/// `Idempotency-Key` header, or (without it) whatever the subscriber's key source names in
/// the body. Answers once the outcome is durable.
#[utoipa::path(post, path = "/v1/subscribers/{s}/messages", tag = "ingest",
    summary = "Ingest one message keyed by the Idempotency-Key header",
    description = "201 the first time, 201 + `Idempotent-Replayed: true` on a retry, 422 for the key reused with another payload, 409 while the same key is in flight (or wait with `Prefer: wait=N`), 400 without a key or for malformed JSON, 403 past ledger.max_implicit_subscribers, 413 too large. Answers once the outcome is durable.",
    params(
        ("s" = String, Path, description = "Subscriber name; an unknown one is registered (up to ledger.max_implicit_subscribers)"),
        ("Idempotency-Key" = Option<String>, Header, description = "The message's idempotency key; required unless the subscriber's key source finds one in the body"),
        ("Partition-Key" = Option<String>, Header, description = "The handler state's entity, for a subscriber whose partition_key source is the envelope key"),
        ("Prefer" = Option<String>, Header, description = "`wait=N` (RFC 7240): while the same key is in flight, wait up to N seconds (at most half of http.request_timeout) for it to be decided instead of a 409"),
    ),
    request_body(
        description = "The payload. Under `application/json` or another `application/*+json` type it must be JSON (400 otherwise); under any other type it is taken as bytes, stored as they are (a body that parses as JSON is read as JSON, so the key source can find its key). Without a token (http.token) the types a web page can send cross-origin (`text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data`) and a body without `Content-Type` are refused (415); with one they are taken too (without `Content-Type`: as JSON).",
        content(
            (serde_json::Value = "application/json"),
            (inline(BinaryBody) = "application/octet-stream"),
            (String = "text/plain"),
        ),
    ),
    responses(
        (status = 201, description = "Processed, or (with `Idempotent-Replayed: true`) processed before", body = Processed,
            headers(
                ("Idempotent-Replayed" = String, description = "`true` when this answers a retry from the stored outcome"),
                ("Preference-Applied" = String, description = "`wait=N` when a `Prefer: wait` was honoured"),
            )),
        (status = 400, description = "No idempotency key, malformed JSON, a bad header or a payload the handler rejected; `field` names it", body = ErrorBody),
        (status = 403, description = "Past ledger.max_implicit_subscribers", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
        (status = 409, description = "The same key is in flight", body = ErrorBody,
            headers(("Retry-After" = String, description = "Seconds"))),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 422, description = "The key was used before with another payload; the request is quarantined", body = ErrorBody),
        (status = 500, description = "The handler failed for good; the message was dead-lettered", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn ingest_message(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let started = Instant::now();
    let name = path(p)?;
    let body = body(b, st.0.http.max_body_bytes)?;
    check_name(&name)?;
    // The request is checked (body, headers, key, partition key) under the settings the
    // subscriber has or would get before it is registered: a refused request must not
    // use up `max_implicit_subscribers`.
    let settings = st.ledger().settings_of(&name)?;
    let message = read_message(&headers, &body, Target::Name(name.clone()), &settings)?;
    let given = message.given.clone();
    key_delivery(
        message.delivery.clone(),
        &settings,
        http::keying(given.as_ref()),
    )
    .map_err(refusal)?;
    let sub = st.ledger().subscriber(&name)?;
    let message = Message {
        delivery: Delivery {
            subscriber: Target::Resolved(sub.clone()),
            ..message.delivery
        },
        given,
    };
    let Routed { job, shard, .. } = route(&st, message)?;
    let key = IdempotencyKey {
        text: job.id.to_string(),
        hash: job.key,
    };
    let fingerprint = job.fingerprint;
    // A retry may wait for the request still holding its key (bounded well inside the
    // request timeout, which covers its own processing too).
    let wait = wait_preference(&headers).map(|w| w.min(st.0.http.request_timeout / 2));
    let outcome = submit(&st, &sub, job, shard, wait).await?;
    metrics::observe_ingest(outcome.name(), started.elapsed().as_secs_f64());
    let mut response = answer(&sub, &key, fingerprint, outcome)?;
    if let Some(w) = wait {
        let applied = HeaderValue::from_str(&format!("wait={}", w.as_secs()));
        if let Ok(v) = applied {
            response.headers_mut().insert(PREFERENCE_APPLIED, v);
        }
    }
    Ok(response)
}

/// `Preference-Applied` (RFC 7240), set when a `Prefer: wait` was honoured.
const PREFERENCE_APPLIED: &str = "preference-applied";

/// The `wait=N` preference of `Prefer` headers (RFC 7240), in seconds.
fn wait_preference(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .filter_map(|p| p.trim().split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("wait"))
        .and_then(|(_, secs)| secs.trim().trim_matches('"').parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// The request as the HTTP source reads it (400 naming the header or `body` at fault).
fn read_message(
    headers: &HeaderMap,
    body: &[u8],
    subscriber: Target,
    settings: &SubscriberSettings,
) -> ApiResult<Message> {
    let pairs: Vec<(&str, Option<&str>)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.to_str().ok()))
        .collect();
    let media_type = guard::media_type(headers);
    let request = http::Request {
        headers: &pairs,
        media_type: media_type.as_deref(),
        body,
        received_at_ms: now_ms(),
    };
    http::message(&request, subscriber, settings)
        .map_err(|e| ApiError::bad(e.field(), e.to_string()))
}

/// Keys, fingerprints and routes the message as every source does.
fn route(st: &AdminState, message: Message) -> ApiResult<Routed> {
    let Message { delivery, given } = message;
    let keying = http::keying(given.as_ref());
    delivery::route(st.ledger(), delivery, keying, st.ingest().ack_sender()).map_err(refusal)
}

/// The answer to a message the routing step refused.
fn refusal(e: RouteError) -> ApiError {
    match e {
        RouteError::Key { error, .. } => ApiError::bad(
            IDEMPOTENCY_KEY,
            format!("missing idempotency key: send an `Idempotency-Key` header ({error})"),
        ),
        RouteError::Entity { error, .. } => ApiError::bad(PARTITION_KEY, error.to_string()),
        RouteError::Subscriber(e) => e.into(),
    }
}

/// Marks the job's key in flight, hands it to its shard and waits for its durable outcome.
/// When the key is in flight already: 409, or with `wait`, waits up to that long for it to
/// be released and tries again (then 409 if it is still held).
async fn submit(
    st: &AdminState,
    sub: &Subscriber,
    mut job: Job,
    shard: usize,
    wait: Option<Duration>,
) -> ApiResult<Outcome> {
    let ingest = st.ingest();
    let key = (sub.id, job.key);
    let deadline = wait.map(|w| Instant::now() + w);
    let (seq, outcome) = loop {
        match ingest.register(Some(key)) {
            Ok(r) => break r,
            Err(StartError::InFlight) => {
                let left = deadline
                    .map(|d| d.saturating_duration_since(Instant::now()))
                    .filter(|left| !left.is_zero());
                let Some(left) = left else {
                    return Err(ApiError::Conflict(
                        "a request with this Idempotency-Key is still being processed; retry later, or send `Prefer: wait=N` to wait for it".into(),
                    ));
                };
                // Released, or the time is up: either way, try again.
                let _ = tokio::time::timeout(left, ingest.released(key)).await;
            }
            Err(StartError::Stopped) => return Err(ApiError::Unavailable("shutting down".into())),
        }
    };
    job.seq = seq;
    ingest
        .send(shard, job)
        .map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    outcome
        .await
        .map_err(|_| ApiError::Unavailable("the engine stopped before deciding".into()))
}

/// The response to a durable outcome.
fn answer(
    sub: &Subscriber,
    key: &IdempotencyKey,
    fingerprint: u64,
    outcome: Outcome,
) -> ApiResult<Response> {
    let reply = Processed {
        subscriber: &sub.name,
        key: &key.text,
        outcome: "processed",
        fingerprint: format!("{fingerprint:016x}"),
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
            "Idempotency-Key {:?} was used before with another payload (stored fingerprint {stored_fingerprint:016x}, this one {fingerprint:016x}); the request is quarantined",
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
