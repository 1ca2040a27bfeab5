//! Projects an order's latest status, ignoring events that arrive out of order.
//!
//! Payload: `{"order_id":"o-1","status":"PAID","version":3}`. If `version` advances the
//! version stored under `order/<order_id>`, the handler writes `order/<order_id>` = the
//! status bytes; a stale (or repeated) version is acknowledged without a write, so state
//! never moves backwards. A payload that does not match is a permanent error.

use dedupd_sdk::{advance_version, state, Handler, HandlerError, HandlerResult, Message};
use serde::Deserialize;

#[derive(Deserialize)]
struct StatusChanged {
    order_id: String,
    status: String,
    version: u64,
}

struct OrderProjection;

impl Handler for OrderProjection {
    fn handle(msg: Message) -> HandlerResult {
        let ev: StatusChanged = msg.json()?;
        if ev.order_id.is_empty() {
            return Err(HandlerError::permanent("empty order_id"));
        }
        let key = format!("order/{}", ev.order_id);
        if advance_version(&key, ev.version) {
            state::put(&key, ev.status);
        }
        Ok(())
    }
}

dedupd_sdk::export_handler!(OrderProjection);
