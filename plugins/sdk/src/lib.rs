//! Guest SDK for **dedupd** business handlers.
//!
//! A handler is a WebAssembly component (target `wasm32-wasip2`) implementing the WIT world
//! `dedupd:handler/dedupd-handler@0.1.0` (`wit/handler.wit` in the dedupd repository). This
//! crate generates the bindings once and wraps them in a small API, so a handler crate only
//! depends on `dedupd-sdk`:
//!
//! ```ignore
//! use dedupd_sdk::{state, HandlerError, Handler, Message};
//!
//! struct Counter;
//!
//! impl Handler for Counter {
//!     fn handle(msg: Message) -> Result<(), HandlerError> {
//!         let n = state::get("count").map_or(0, |v| v.len());
//!         state::put("count", vec![0u8; n + 1]);
//!         Ok(())
//!     }
//! }
//!
//! dedupd_sdk::export_handler!(Counter);
//! ```
//!
//! Semantics (see the WIT file for the full contract): `handle` runs at least once per
//! message; everything written through [`state`], [`insert_unique`], [`advance_version`],
//! [`compare_and_set`](state::compare_and_set) and [`emit`] commits atomically with the
//! message's claim, or not at all when `handle` returns an error or traps (a panic traps).
//! External side effects should carry [`operation_key`] as their idempotency key.
//!
//! State scope: a subscriber without a `partition_key` has one store for all its messages;
//! with a `partition_key` (say `/order_id`) every entity (order) has a store of its own, and
//! a handler sees only its message's entity. Choose the partition key so that everything a
//! handler reads and writes belongs to one entity.

#![warn(missing_docs)]

#[allow(missing_docs)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "dedupd-handler",
        // Cross-crate export: the generated macro is `#[macro_export]`ed (its real name is
        // `dedupd_sdk::__export_dedupd_handler_impl!`) and aliased as
        // `dedupd_sdk::__private::export!`. Invoked as `export!(T)` it finds the generated
        // types through `default_bindings_module`; `export_handler!` below instead passes
        // `with_types_in $crate::__private`, so a renamed dependency works too. The macro
        // also carries the custom section describing the world's exports, so the
        // component's export is found even though the bindings live in this rlib.
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "dedupd_sdk::__private",
    });
}

/// The raw generated bindings. Not a stable API; used by [`export_handler!`].
#[doc(hidden)]
pub mod __private {
    pub use crate::bindings::*;
}

use bindings::dedupd::handler::host;

pub use bindings::dedupd::handler::host::{Entry, Level};
pub use bindings::exports::dedupd::handler::handler::{HandlerError, Message};

/// What [`Handler::handle`] returns.
pub type HandlerResult = Result<(), HandlerError>;

/// A business handler. Implement it on a unit struct and export it with
/// [`export_handler!`].
pub trait Handler {
    /// Handles one message. `Ok(())` commits every write of this call together with the
    /// message's claim; an error (or a trap/panic) rolls all of them back.
    fn handle(msg: Message) -> HandlerResult;
}

/// Exports a [`Handler`] implementation as the component's `dedupd:handler/handler`.
///
/// ```ignore
/// struct MyHandler;
/// impl dedupd_sdk::Handler for MyHandler { /* ... */ }
/// dedupd_sdk::export_handler!(MyHandler);
/// ```
///
/// Use it exactly once per handler crate (a `cdylib`), at the crate root or in any module.
#[macro_export]
macro_rules! export_handler {
    ($ty:ident) => {
        impl $crate::__private::exports::dedupd::handler::handler::Guest for $ty {
            #[inline]
            fn handle(msg: $crate::Message) -> ::core::result::Result<(), $crate::HandlerError> {
                <$ty as $crate::Handler>::handle(msg)
            }
        }
        $crate::__private::export!($ty with_types_in $crate::__private);
    };
}

impl HandlerError {
    /// A retryable failure: the engine retries the message (bounded, with backoff), then
    /// dead-letters it.
    pub fn retryable(reason: impl Into<String>) -> Self {
        HandlerError::Retryable(reason.into())
    }

    /// A permanent failure: the engine dead-letters the message now.
    pub fn permanent(reason: impl Into<String>) -> Self {
        HandlerError::Permanent(reason.into())
    }

    /// Whether this is [`HandlerError::Retryable`].
    pub fn is_retryable(&self) -> bool {
        matches!(self, HandlerError::Retryable(_))
    }

    /// The reason text.
    pub fn reason(&self) -> &str {
        match self {
            HandlerError::Retryable(r) | HandlerError::Permanent(r) => r,
        }
    }
}

#[cfg(feature = "json")]
impl From<serde_json::Error> for HandlerError {
    /// A payload that does not parse is a permanent error: retrying cannot fix it.
    fn from(e: serde_json::Error) -> Self {
        HandlerError::Permanent(format!("invalid payload: {e}"))
    }
}

impl Message {
    /// The payload as UTF-8 text (JSON input arrives as canonical JSON; a Kafka record
    /// value or a non-JSON HTTP body arrives as sent and may not be UTF-8; the error is
    /// permanent).
    pub fn payload_str(&self) -> Result<&str, HandlerError> {
        core::str::from_utf8(&self.payload)
            .map_err(|e| HandlerError::Permanent(format!("payload is not UTF-8: {e}")))
    }

    /// Deserializes the JSON payload; a payload that does not match `T` is a permanent
    /// error.
    #[cfg(feature = "json")]
    pub fn json<'a, T: serde::Deserialize<'a>>(&'a self) -> Result<T, HandlerError> {
        Ok(serde_json::from_slice(&self.payload)?)
    }

    /// The first header named `name` (case-sensitive), if any.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Key/value state of this subscriber, read-your-writes inside one `handle` call.
///
/// Writes are buffered in the message's transaction and applied only if `handle` returns
/// `Ok`.
pub mod state {
    use super::{host, Entry};

    /// Reads `key`; sees this call's own earlier writes.
    pub fn get(key: impl AsRef<[u8]>) -> Option<Vec<u8>> {
        host::get(key.as_ref())
    }

    /// Writes `key` = `value`.
    pub fn put(key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) {
        host::put(key.as_ref(), value.as_ref())
    }

    /// Deletes `key` (a no-op if absent).
    pub fn delete(key: impl AsRef<[u8]>) {
        host::delete(key.as_ref())
    }

    /// Entries whose key starts with `prefix`, in key order, at most `limit` (the host caps
    /// it at 1000).
    pub fn scan(prefix: impl AsRef<[u8]>, limit: u32) -> Vec<Entry> {
        host::scan(prefix.as_ref(), limit)
    }

    /// Writes `new` if the current value equals `expected` (`None`: the key must be
    /// absent). Returns whether it wrote.
    pub fn compare_and_set(
        key: impl AsRef<[u8]>,
        expected: Option<&[u8]>,
        new: impl AsRef<[u8]>,
    ) -> bool {
        host::compare_and_set(key.as_ref(), expected, new.as_ref())
    }
}

pub use state::compare_and_set;

/// Business uniqueness: records `key` in `namespace`; `true` the first time, `false` if any
/// earlier message of this subscriber already recorded it.
pub fn insert_unique(namespace: &str, key: &str) -> bool {
    host::insert_unique(namespace, key)
}

/// Ordering guard: stores `version` under `key` and returns `true` only if it is greater
/// than the stored one (or none is stored). A stale event returns `false` and changes
/// nothing.
pub fn advance_version(key: &str, version: u64) -> bool {
    host::advance_version(key, version)
}

/// Queues an outbound message in the transactional outbox; returns its deterministic
/// message id (the same on every attempt of this message).
pub fn emit(
    topic: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    payload: impl AsRef<[u8]>,
) -> String {
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    host::emit(topic, key, &headers, payload.as_ref())
}

/// A deterministic idempotency key for the external operation `name`, the same on every
/// attempt of this message.
pub fn operation_key(name: &str) -> String {
    host::operation_key(name)
}

/// The message's received-at time (ms since the epoch), not the wall clock: retries see the
/// same value.
pub fn now_ms() -> u64 {
    host::now_ms()
}

/// The engine's log (rate-limited per subscriber).
pub mod log {
    use super::{host, Level};

    /// Logs `text` at `level`.
    pub fn log(level: Level, text: &str) {
        host::log(level, text)
    }
    /// Logs at trace level.
    pub fn trace(text: &str) {
        log(Level::Trace, text)
    }
    /// Logs at debug level.
    pub fn debug(text: &str) {
        log(Level::Debug, text)
    }
    /// Logs at info level.
    pub fn info(text: &str) {
        log(Level::Info, text)
    }
    /// Logs at warn level.
    pub fn warn(text: &str) {
        log(Level::Warn, text)
    }
    /// Logs at error level.
    pub fn error(text: &str) {
        log(Level::Error, text)
    }
}

/// Re-exported so handlers can use `dedupd_sdk::serde_json` without their own dependency.
#[cfg(feature = "json")]
pub use serde_json;
