//! Does nothing and succeeds: the baseline for measuring the engine's per-call overhead
//! (instantiation or reuse, lifting the message, lowering the result).

use dedupd_sdk::{Handler, HandlerResult, Message};

struct Noop;

impl Handler for Noop {
    fn handle(_msg: Message) -> HandlerResult {
        Ok(())
    }
}

dedupd_sdk::export_handler!(Noop);
