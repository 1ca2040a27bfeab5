//! One message id of a subscriber: its live claim (`GET .../messages/{id}`), and
//! forgetting it (`DELETE`) so the next delivery of that id runs the handler again.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::Json;
use serde_json::{json, Value};

use super::{audit, blocking, known, now_ms, path, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized};
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

/// The live claim of a message id. With a token configured it needs the token: its 200 or
/// 404 would tell anyone whether a guessed id (an e-mail address under a JSON-pointer key)
/// was seen, and its fingerprint would confirm a guessed payload.
pub async fn get_claim(
    _auth: Authorized,
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
            let shown = json!({
                "subscriber": &*sub.name,
                "id": id,
                "processed_at_ms": c.processed_at_ms,
                "expires_at_ms": c.expires_at_ms,
                "fingerprint": format!("{:016x}", c.fingerprint),
                "handler_version": format!("{:016x}", c.handler_version),
            });
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
