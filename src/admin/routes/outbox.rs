//! The outbox without Kafka: what handlers emitted, pulled over HTTP and acknowledged
//! (`GET /v1/outbox`, `POST /v1/outbox/ack`). Rows stay until acknowledged, so a consumer
//! that crashes between a pull and its ack pulls them again (at least once; each row
//! carries the emitted message's deterministic id to deduplicate by). While a Kafka relay
//! consumes the outbox (`dedupd run` with `[kafka.outbox]`) both routes answer 409: two
//! consumers would each get every row.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{blocking, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized};
use crate::ledger::{Ledger, StoredPayload};

/// Most rows one pull returns.
const MAX_PULL: usize = 1000;

#[derive(Debug, Deserialize)]
pub struct Pull {
    limit: Option<usize>,
}

#[derive(Debug, Deserialize)]
pub struct Ack {
    ids: Vec<String>,
}

fn not_relayed(ledger: &Ledger) -> ApiResult<()> {
    if ledger.outbox_relayed() {
        return Err(ApiError::Relayed(
            "the outbox is relayed to Kafka ([kafka.outbox]); it cannot also be pulled".into(),
        ));
    }
    Ok(())
}

/// The oldest pending rows (`?limit=N`, 1-1000, default 100) and how many are pending.
pub async fn pull_outbox(
    _auth: Authorized,
    State(st): State<AdminState>,
    q: Result<Query<Pull>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = q.map_err(|e| ApiError::bad("limit", e.body_text()))?;
    let limit = q.limit.unwrap_or(100);
    if limit == 0 || limit > MAX_PULL {
        return Err(ApiError::bad(
            "limit",
            format!("`limit` must be between 1 and {MAX_PULL}"),
        ));
    }
    let ledger = st.ledger().clone();
    not_relayed(&ledger)?;
    blocking(move || {
        let rows = ledger.outbox_pending(limit)?;
        let pending = ledger.outbox_len()?;
        let messages: Vec<Value> = rows
            .into_iter()
            .map(|r| {
                let mut v = json!({
                    "id": r.id,
                    "subscriber": r.subscriber,
                    "message_id": r.message_id,
                    "topic": r.topic,
                    "key": r.key,
                    "headers": r.headers,
                    "written_at_ms": r.written_at_ms,
                });
                if let (Some(o), Ok(Value::Object(p))) = (
                    v.as_object_mut(),
                    serde_json::to_value(StoredPayload::of(&r.payload)),
                ) {
                    o.extend(p);
                }
                v
            })
            .collect();
        Ok(Json(json!({"messages": messages, "pending": pending})))
    })
    .await
}

/// Deletes pulled rows: `{"ids": [...]}` as `GET /v1/outbox` named them. Acknowledging a
/// row twice, or one already gone, is not an error.
pub async fn ack_outbox(
    _auth: Authorized,
    State(st): State<AdminState>,
    body: Result<Json<Ack>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Json(ack) = body.map_err(|e| ApiError::bad("ids", e.body_text()))?;
    if ack.ids.len() > MAX_PULL {
        return Err(ApiError::bad(
            "ids",
            format!("at most {MAX_PULL} ids per acknowledgement"),
        ));
    }
    let ledger = st.ledger().clone();
    not_relayed(&ledger)?;
    blocking(move || {
        ledger.outbox_ack(&ack.ids).map_err(|e| match e {
            crate::ledger::LedgerError::Invalid(m) => ApiError::bad("ids", m),
            e => e.into(),
        })?;
        let pending = ledger.outbox_len()?;
        Ok(Json(json!({"acked": ack.ids.len(), "pending": pending})))
    })
    .await
}
