//! {{name}}: a dedupd handler that counts the events of each order.
//!
//! Payload: a JSON object with a string `order_id`, e.g. `{"type":"OrderPlaced","order_id":"o-1"}`.
//! Each event adds one to `count/<order_id>` in the handler's state (a decimal number).
//!
//! A plain `get + 1` is safe here because dedupd runs a handler once per message id: a
//! redelivery of the same event is recognised as a duplicate and never reaches `handle`,
//! and every write below commits together with the message's claim, or not at all.

use dedupd_sdk::{log, state, Handler, HandlerError, HandlerResult, Message};
use serde::Deserialize;

/// The fields this handler reads; any others in the payload are ignored.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow)]
    order_id: &'a str,
}

struct CountPerOrder;

impl Handler for CountPerOrder {
    fn handle(msg: Message) -> HandlerResult {
        // Not JSON, or no string `order_id`: a permanent error, so the message is
        // dead-lettered instead of retried.
        let event: Event = msg
            .json()
            .map_err(|_| HandlerError::permanent("payload without a string order_id"))?;
        if event.order_id.is_empty() {
            return Err(HandlerError::permanent("empty order_id"));
        }
        let key = format!("count/{}", event.order_id);
        let count = state::get(&key)
            .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u64>().ok())
            .unwrap_or(0);
        state::put(&key, (count + 1).to_string());
        log::info(&format!("{key} = {}", count + 1));
        Ok(())
    }
}

dedupd_sdk::export_handler!(CountPerOrder);
