//! Creates exactly one shipping label per order, however many distinct events carry it.
//!
//! Payload: `{"type":"OrderPlaced","order_id":"o-1",...}`. For `OrderPlaced` the handler
//! records `order_id` in the `label` uniqueness namespace and, only the first time, writes
//! `label/<order_id>` = `{"label_id":"<operation_key(\"label\")>","order_id":"<order_id>"}`.
//! Message-id dedup already stops redeliveries; `insert_unique` additionally stops two
//! *different* events (say, a producer retry with a fresh id) from creating two labels.
//! Other event types are acknowledged without writes; an `OrderPlaced` without a string
//! `order_id`, or any event whose `order_id` is not a string, is a permanent error. Fields
//! are borrowed from the payload, so the common case parses without allocating.

use std::borrow::Cow;

use dedupd_sdk::{
    insert_unique, operation_key, state, Handler, HandlerError, HandlerResult, Message,
};
use serde::{Deserialize, Serialize};

/// Borrowed from the payload where possible: no allocation for the common case.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    order_id: Option<Cow<'a, str>>,
}

#[derive(Serialize)]
struct Label<'a> {
    label_id: String,
    order_id: &'a str,
}

struct ShippingLabel;

impl Handler for ShippingLabel {
    fn handle(msg: Message) -> HandlerResult {
        let event: Event = msg.json()?;
        if event.kind != "OrderPlaced" {
            return Ok(());
        }
        let order_id = match &event.order_id {
            Some(id) if !id.is_empty() => id.as_ref(),
            _ => {
                return Err(HandlerError::permanent(
                    "OrderPlaced without a string order_id",
                ))
            }
        };
        if insert_unique("label", order_id) {
            let label = Label {
                label_id: operation_key("label"),
                order_id,
            };
            state::put(format!("label/{order_id}"), serde_json::to_vec(&label)?);
        }
        Ok(())
    }
}

dedupd_sdk::export_handler!(ShippingLabel);
