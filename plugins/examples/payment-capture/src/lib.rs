//! Captures a payment once: an idempotency key for the payment provider, an outbox event
//! and a state record, all committed with the message's claim.
//!
//! Payload: `{"payment_id":"p-1","amount_cents":1999}`. The handler derives
//! `op = operation_key("capture")` (identical on every attempt, so a real provider call made
//! with it is safe to retry), emits `payments.captured` keyed by `payment_id` with header
//! `operation-key: <op>`, and writes `payment/<payment_id>` =
//! `{"operation_key":"<op>","status":"captured"}`. An invalid payload is a permanent error.

use dedupd_sdk::{emit, operation_key, state, Handler, HandlerError, HandlerResult, Message};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct CaptureRequested {
    payment_id: String,
    amount_cents: u64,
}

#[derive(Serialize)]
struct Captured<'a> {
    amount_cents: u64,
    operation_key: &'a str,
    payment_id: &'a str,
}

#[derive(Serialize)]
struct PaymentState<'a> {
    operation_key: &'a str,
    status: &'a str,
}

struct PaymentCapture;

impl Handler for PaymentCapture {
    fn handle(msg: Message) -> HandlerResult {
        let req: CaptureRequested = msg.json()?;
        if req.payment_id.is_empty() {
            return Err(HandlerError::permanent("empty payment_id"));
        }
        let op = operation_key("capture");
        // A real handler would call the provider here, passing `op` as its idempotency key.
        let event = Captured {
            amount_cents: req.amount_cents,
            operation_key: &op,
            payment_id: &req.payment_id,
        };
        emit(
            "payments.captured",
            Some(&req.payment_id),
            &[("operation-key", &op)],
            serde_json::to_vec(&event)?,
        );
        let record = PaymentState {
            operation_key: &op,
            status: "captured",
        };
        state::put(
            format!("payment/{}", req.payment_id),
            serde_json::to_vec(&record)?,
        );
        Ok(())
    }
}

dedupd_sdk::export_handler!(PaymentCapture);
