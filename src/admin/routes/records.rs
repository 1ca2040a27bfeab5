//! Quarantine and dead letters of a subscriber: list (payloads left out, and what could
//! reveal one redacted without the token), read one whole, discard, and replay through the
//! handler.

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use super::{audit, blocking, known, path, redact, ApiResult, Redacted};
use crate::admin::{Access, AdminState, ApiError, Authorized, ErrorBody};
use crate::ledger::{Outcome, RecordKind, StoredRecord};

/// A page of a record list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct Page {
    /// The `next` of the previous page; the first page without it.
    after: Option<String>,
    /// Records per page, 1-1000 (default 50); a page also ends after about 1 MiB of
    /// stored records.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

/// A quarantined message or a dead letter as the API shows it: its stored record, with
/// `id` the record id, the message's own id as `message_id`, and `kind` the record kind.
/// Lists leave out `payload`, `payload_base64` and `headers`; without the token (when one
/// is configured) they also leave out what could reveal a payload and say so in
/// `redacted`. Records are shown from their stored JSON, so this type only describes them.
#[derive(ToSchema)]
#[allow(
    dead_code,
    reason = "describes the stored records for the API document; never built"
)]
pub(super) struct RecordView {
    /// `{shard}-{seq}`: stable for the record's lifetime.
    id: String,
    kind: RecordKind,
    subscriber: String,
    /// The message's idempotency key text.
    message_id: Option<String>,
    /// The key's 128-bit hash, 32 hex digits.
    key_hash: Option<String>,
    /// The payload's fingerprint, 16 hex digits.
    fingerprint: Option<String>,
    /// Quarantine: the fingerprint of the payload the claim was made for.
    stored_fingerprint: Option<String>,
    /// Why it was set aside (a handler's failure text for a dead letter).
    reason: Option<String>,
    /// Dead letters: handler calls made.
    attempts: Option<u32>,
    received_at_ms: Option<u64>,
    /// Dead letters: when the last attempt failed.
    failed_at_ms: Option<u64>,
    /// The partition key, if the message had one.
    key: Option<String>,
    /// The message's headers as `[name, value]` pairs (one record only).
    #[schema(value_type = Option<Vec<Vec<String>>>)]
    headers: Option<Vec<(String, String)>>,
    /// Where it came from (topic/partition/offset, subject, ...).
    origin: Option<String>,
    /// The payload as text when it is UTF-8 (one record only).
    payload: Option<String>,
    /// The payload in base64 when it is not UTF-8 (one record only).
    payload_base64: Option<String>,
    /// Deliveries this record stands for.
    count: Option<u64>,
    stored_at_ms: Option<u64>,
    last_seen_ms: Option<u64>,
    /// Layout version of the stored record.
    v: Option<u32>,
    redacted: Option<Redacted>,
}

/// A page of records.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RecordList {
    subscriber: String,
    #[schema(value_type = Vec<RecordView>)]
    records: Vec<Value>,
    /// The `after` of the next page; `null`: this was the last.
    next: Option<String>,
}

/// `DELETE` of a record.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Discarded {
    subscriber: String,
    record: String,
    /// Always `true` (no record is a 404).
    discarded: bool,
}

/// A replay's outcome.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Replayed {
    subscriber: String,
    record: String,
    /// `processed`, `duplicate`, `quarantined`, `dead_lettered` or `rejected`.
    outcome: &'static str,
    /// Why, for an outcome other than processed or duplicate.
    reason: Option<String>,
}

/// Fields of a listed record that can quote or confirm a payload: handler failure reasons
/// (often the offending field), fingerprints (unkeyed hashes of the payload) and the
/// partition key (often a payload field).
const PAYLOAD_REVEALING: &[&str] = &[
    "reason",
    "fingerprint",
    "stored_fingerprint",
    "key",
    // With a JSON-pointer or content-hash key source the id is payload data (an e-mail
    // address, say), and its hash is unkeyed: both would confirm a guess.
    "message_id",
    "key_hash",
];

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
) -> ApiResult<Json<RecordList>> {
    let name = path(p)?;
    let Query(page) = q.map_err(|e| ApiError::bad("query", e.body_text()))?;
    let limit = page.limit.unwrap_or(50);
    if limit == 0 || limit > 1000 {
        return Err(ApiError::bad("limit", "`limit` must be between 1 and 1000"));
    }
    let ledger = st.ledger().clone();
    known(&ledger, &name)?;
    blocking(move || {
        let found = ledger.record_page(kind, &name, page.after.as_deref(), limit)?;
        let next = found.next;
        let records: Vec<Value> = found
            .records
            .iter()
            .map(|r| {
                let mut v = shown(r, false);
                if access == Access::Redacted {
                    redact(&mut v, PAYLOAD_REVEALING);
                }
                v
            })
            .collect();
        Ok(Json(RecordList {
            subscriber: name,
            records,
            next,
        }))
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
) -> ApiResult<Json<Discarded>> {
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
        Ok(Json(Discarded {
            subscriber: name,
            record: rid,
            discarded: true,
        }))
    })
    .await
}

async fn replay_record(
    st: AdminState,
    kind: RecordKind,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Replayed>> {
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
    Ok(Json(Replayed {
        subscriber: name,
        record: rid,
        outcome: outcome.name(),
        reason: outcome.reason(),
    }))
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/quarantine", tag = "records",
    summary = "Quarantined messages, without payloads; reasons, fingerprints and keys only with the token when one is configured; page with ?after=ID&limit=N",
    params(("s" = String, Path, description = "Subscriber name"), Page),
    responses(
        (status = 200, description = "A page of records", body = RecordList),
        (status = 400, description = "Not a valid subscriber name, or a bad `limit`", body = ErrorBody),
        (status = 403, description = "A wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn list_quarantine(
    access: Access,
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<Page>, QueryRejection>,
) -> ApiResult<Json<RecordList>> {
    list_records(st, access, RecordKind::Quarantine, p, q).await
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/deadletters", tag = "records",
    summary = "Dead letters, without payloads; reasons, fingerprints and keys only with the token when one is configured; page with ?after=ID&limit=N",
    params(("s" = String, Path, description = "Subscriber name"), Page),
    responses(
        (status = 200, description = "A page of records", body = RecordList),
        (status = 400, description = "Not a valid subscriber name, or a bad `limit`", body = ErrorBody),
        (status = 403, description = "A wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn list_deadletters(
    access: Access,
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<Page>, QueryRejection>,
) -> ApiResult<Json<RecordList>> {
    list_records(st, access, RecordKind::DeadLetter, p, q).await
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/quarantine/{rid}", tag = "records",
    summary = "One quarantined message with its payload",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "The record", body = RecordView),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn get_quarantine(
    _auth: Authorized,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    get_record(st, RecordKind::Quarantine, p).await
}

#[utoipa::path(get, path = "/v1/subscribers/{s}/deadletters/{rid}", tag = "records",
    summary = "One dead letter with its payload",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "The record", body = RecordView),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn get_deadletter(
    _auth: Authorized,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Value>> {
    get_record(st, RecordKind::DeadLetter, p).await
}

#[utoipa::path(delete, path = "/v1/subscribers/{s}/quarantine/{rid}", tag = "records",
    summary = "Discard a quarantined message (audited)",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "Discarded", body = Discarded),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn discard_quarantine(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Discarded>> {
    discard_record(st, RecordKind::Quarantine, p).await
}

#[utoipa::path(delete, path = "/v1/subscribers/{s}/deadletters/{rid}", tag = "records",
    summary = "Discard a dead letter (audited)",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "Discarded", body = Discarded),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn discard_deadletter(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Discarded>> {
    discard_record(st, RecordKind::DeadLetter, p).await
}

#[utoipa::path(post, path = "/v1/subscribers/{s}/quarantine/{rid}/replay", tag = "records",
    summary = "Reprocess a quarantined message through the current handler (audited); it replaces the conflicting claim",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "Replayed; `outcome` says how it went", body = Replayed),
        (status = 400, description = "Not a valid subscriber name, or a record without an idempotency key", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
        (status = 503, description = "Shutting down, or the engine stopped", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn replay_quarantine(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Replayed>> {
    replay_record(st, RecordKind::Quarantine, p).await
}

#[utoipa::path(post, path = "/v1/subscribers/{s}/deadletters/{rid}/replay", tag = "records",
    summary = "Reprocess a dead letter through the current handler (audited)",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("rid" = String, Path, description = "Record id (`id` in the list)"),
    ),
    responses(
        (status = 200, description = "Replayed; `outcome` says how it went", body = Replayed),
        (status = 400, description = "Not a valid subscriber name, or a record without an idempotency key", body = ErrorBody),
        (status = 404, description = "No such subscriber or record", body = ErrorBody),
        (status = 503, description = "Shutting down, or the engine stopped", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn replay_deadletter(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Replayed>> {
    replay_record(st, RecordKind::DeadLetter, p).await
}
