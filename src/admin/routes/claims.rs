//! One message id of a subscriber: its live claim (`GET .../messages/{id}`), and
//! forgetting it (`DELETE`) so the next delivery of that id runs the handler again.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use super::{audit, blocking, known, now_ms, path, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized, ErrorBody};
use crate::envelope::IdempotencyKey;
use crate::ledger::Subscriber;

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

/// A live claim (`GET /v1/subscribers/{s}/messages/{id}`).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Claim {
    subscriber: String,
    /// The message id as given.
    id: String,
    processed_at_ms: u64,
    expires_at_ms: u64,
    /// xxh3-64 of the payload the claim was made for, 16 hex digits.
    fingerprint: String,
    /// Version of the handler that processed it, 16 hex digits.
    handler_version: String,
}

/// `DELETE /v1/subscribers/{s}/messages/{id}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Forgotten {
    subscriber: String,
    id: String,
    /// Always `true` (no claim is a 404).
    forgotten: bool,
}

/// The live claim of a message id. With a token configured it needs the token: its 200 or
/// 404 would tell anyone whether a guessed id (an e-mail address under a JSON-pointer key)
/// was seen, and its fingerprint would confirm a guessed payload.
#[utoipa::path(get, path = "/v1/subscribers/{s}/messages/{id}", tag = "claims",
    summary = "The live claim of a message id (processed-at, fingerprint, expires-at, handler version)",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("id" = String, Path, description = "Message id (the idempotency key's text)"),
    ),
    responses(
        (status = 200, description = "The live claim", body = Claim),
        (status = 400, description = "Not a valid subscriber name, or an empty or too long id", body = ErrorBody),
        (status = 404, description = "No such subscriber, or no live claim", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn get_claim(
    _auth: Authorized,
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Claim>> {
    let (name, id) = path(p)?;
    let ledger = st.ledger().clone();
    let sub = known(&ledger, &name)?;
    let key = claim_key(&sub, &id)?;
    let claim = blocking(move || Ok(ledger.lookup(&name, key)?)).await?;
    match claim {
        Some(c) if c.is_live(now_ms()) => Ok(Json(Claim {
            subscriber: sub.name.to_string(),
            id,
            processed_at_ms: c.processed_at_ms,
            expires_at_ms: c.expires_at_ms,
            fingerprint: format!("{:016x}", c.fingerprint),
            handler_version: format!("{:016x}", c.handler_version),
        })),
        _ => Err(ApiError::NotFound(format!("no live claim for {id:?}"))),
    }
}

#[utoipa::path(delete, path = "/v1/subscribers/{s}/messages/{id}", tag = "claims",
    summary = "Forget a claim so the next delivery is processed again (audited)",
    params(
        ("s" = String, Path, description = "Subscriber name"),
        ("id" = String, Path, description = "Message id (the idempotency key's text)"),
    ),
    responses(
        (status = 200, description = "Forgotten", body = Forgotten),
        (status = 400, description = "Not a valid subscriber name, or an empty or too long id", body = ErrorBody),
        (status = 404, description = "No such subscriber, or no live claim", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn forget_claim(
    State(st): State<AdminState>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Forgotten>> {
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
        Ok(Json(Forgotten {
            subscriber: sub.name.to_string(),
            id,
            forgotten: true,
        }))
    } else {
        Err(ApiError::NotFound(format!("no live claim for {id:?}")))
    }
}
