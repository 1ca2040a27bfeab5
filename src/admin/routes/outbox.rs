//! The outbox without Kafka: what handlers emitted, pulled over HTTP and acknowledged
//! (`GET /v1/outbox`, `POST /v1/outbox/ack`). Rows stay until acknowledged, so a consumer
//! that crashes between a pull and its ack pulls them again (at least once; each row
//! carries the emitted message's deterministic id to deduplicate by). While a relay
//! consumes the outbox (`dedupd run` with `[kafka.outbox]`, on by default, or
//! `[rabbitmq.outbox]`) both routes answer 409 (code `relayed_to_kafka`, kept for either
//! relay): two consumers would each get every row.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{blocking, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized, ErrorBody};
use crate::ledger::{Ledger, StoredPayload};

/// Most rows one pull returns.
const MAX_PULL: usize = 1000;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct Pull {
    /// Rows to return, 1-1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct Ack {
    /// Row ids as `GET /v1/outbox` named them, at most 1000.
    #[schema(max_items = 1000)]
    ids: Vec<String>,
}

/// A message a handler emitted, waiting to be pulled and acknowledged.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct OutboxMessage {
    /// The row id to acknowledge.
    id: String,
    subscriber: String,
    /// Deterministic id derived from the incoming message id (the same on every
    /// redelivery): deduplicate by it.
    message_id: String,
    topic: String,
    key: Option<String>,
    /// `[name, value]` pairs.
    #[schema(value_type = Vec<Vec<String>>)]
    headers: Vec<(String, String)>,
    written_at_ms: u64,
    #[serde(flatten)]
    payload: StoredPayload,
}

/// `GET /v1/outbox`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Pulled {
    /// Oldest first (per shard).
    messages: Vec<OutboxMessage>,
    /// Rows not yet acknowledged, these included.
    pending: u64,
}

/// `POST /v1/outbox/ack`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Acked {
    /// Ids given.
    acked: usize,
    /// Rows not yet acknowledged.
    pending: u64,
}

fn not_relayed(ledger: &Ledger) -> ApiResult<()> {
    if ledger.outbox_relayed() {
        return Err(ApiError::Relayed(
            "the outbox is relayed to the broker ([kafka.outbox] or [rabbitmq.outbox]); it cannot also be pulled".into(),
        ));
    }
    Ok(())
}

/// The oldest pending rows (`?limit=N`, 1-1000, default 100) and how many are pending.
#[utoipa::path(get, path = "/v1/outbox", tag = "outbox",
    summary = "The oldest messages handlers emitted, not yet acknowledged, and how many are pending",
    params(Pull),
    responses(
        (status = 200, description = "The oldest pending rows", body = Pulled),
        (status = 400, description = "A bad `limit`", body = ErrorBody),
        (status = 409, description = "The outbox is relayed to the broker ([kafka.outbox] or [rabbitmq.outbox])", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn pull_outbox(
    _auth: Authorized,
    State(st): State<AdminState>,
    q: Result<Query<Pull>, QueryRejection>,
) -> ApiResult<Json<Pulled>> {
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
        let messages = rows
            .into_iter()
            .map(|r| OutboxMessage {
                payload: StoredPayload::of(&r.payload),
                id: r.id,
                subscriber: r.subscriber,
                message_id: r.message_id,
                topic: r.topic,
                key: r.key,
                headers: r.headers,
                written_at_ms: r.written_at_ms,
            })
            .collect();
        Ok(Json(Pulled { messages, pending }))
    })
    .await
}

/// Deletes pulled rows: `{"ids": [...]}` as `GET /v1/outbox` named them. Acknowledging a
/// row twice, or one already gone, is not an error.
#[utoipa::path(post, path = "/v1/outbox/ack", tag = "outbox",
    summary = "Delete pulled outbox messages",
    request_body(content = Ack, description = "The rows to delete"),
    responses(
        (status = 200, description = "Deleted (a row acknowledged twice, or gone, is no error)", body = Acked),
        (status = 400, description = "Not such an object, more than 1000 ids, or an id that is not a row id", body = ErrorBody),
        (status = 409, description = "The outbox is relayed to the broker ([kafka.outbox] or [rabbitmq.outbox])", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn ack_outbox(
    _auth: Authorized,
    State(st): State<AdminState>,
    body: Result<Json<Ack>, JsonRejection>,
) -> ApiResult<Json<Acked>> {
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
        Ok(Json(Acked {
            acked: ack.ids.len(),
            pending,
        }))
    })
    .await
}
