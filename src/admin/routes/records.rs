//! Quarantine and dead letters of a subscriber: list (payloads left out, and what could
//! reveal one redacted without the token), read one whole, discard, and replay through the
//! handler.

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{audit, blocking, known, path, redact, ApiResult};
use crate::admin::{Access, AdminState, ApiError, Authorized};
use crate::ledger::{Outcome, RecordKind, StoredRecord};

#[derive(Debug, Deserialize)]
pub struct Page {
    after: Option<String>,
    limit: Option<usize>,
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
