//! The seam between the ledger (redb) and message handlers (wasmtime): plain types, no
//! dependency on either. A handler reads state through a [`StateReader`] and returns
//! [`Effects`]; the ledger applies them in the same transaction as the message's claim, or
//! drops them when the handler fails (G6).

use std::collections::{BTreeMap, BTreeSet};

/// One state entry: key and value.
pub type StateEntry = (Vec<u8>, Vec<u8>);

/// A message as a handler sees it.
#[derive(Debug, Clone, Default)]
pub struct HandlerMessage {
    pub subscriber: String,
    /// The idempotency key's text.
    pub id: String,
    /// The idempotency key's 128-bit hash, the claim's key. Derived identities (operation
    /// keys, emitted ids, the random stream) come from it when the text alone does not
    /// identify the message (a CloudEvents `source#id`, a header id that is not UTF-8).
    pub key_hash: u128,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    /// 1 on the first attempt.
    pub attempt: u32,
    pub received_at_ms: u64,
}

/// An outbound message queued by a handler, relayed after commit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OutboxMessage {
    /// Deterministic: derived from the incoming id and the emit's position.
    pub id: String,
    pub topic: String,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    /// The changelog partition holding this message's emitted record, when its subscriber
    /// publishes a changelog (`source/kafka/changelog/`): the relay tombstones that
    /// record once the broker acknowledged the message, so the partition's next owner
    /// relays only what was not. Not part of the record.
    #[serde(skip)]
    pub changelog_partition: Option<i32>,
}

/// Everything one successful handler call wants to change, applied atomically with the
/// message's claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    /// Key -> new value (`None`: delete).
    pub state: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Marks recorded by `insert-unique`, each encoded by [`unique_key`].
    pub(crate) uniques: BTreeSet<Vec<u8>>,
    /// Versions advanced by `advance-version`.
    pub(crate) versions: BTreeMap<String, u64>,
    pub outbox: Vec<OutboxMessage>,
}

impl Effects {}

/// An `insert-unique` mark as stored: `namespace 0x00 key`. Namespaces hold no NUL byte, so
/// the encoding is unambiguous, and one byte string compares with a single memcmp.
pub(crate) fn unique_key(namespace: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(namespace.len() + key.len() + 1);
    k.extend_from_slice(namespace.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

/// Committed state of one subscriber as of this batch, including the effects of earlier
/// successful messages of the same batch.
pub trait StateReader: Send {
    fn get(&self, key: &[u8]) -> Option<Vec<u8>>;
    /// Entries with `prefix`, in key order, at most `limit`.
    fn scan(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry>;
    /// Whether a mark (encoded by `unique_key`) exists.
    fn unique_exists(&self, mark: &[u8]) -> bool;
    fn version(&self, key: &str) -> Option<u64>;
    /// Scopes the next call's reads and writes to an entity (`None`: the whole store).
    /// Readers without entities ignore it.
    fn set_scope(&mut self, _entity: Option<&str>) {}
    /// Folds the effects of a message that succeeded into the view, so later messages of
    /// the same batch read them.
    fn absorb(&mut self, effects: Effects);
    /// Everything absorbed during the batch, to be written with its claims.
    fn finish(self: Box<Self>) -> Absorbed;
}

/// What a batch's calls wrote, as its commit writes it.
#[derive(Debug, Default)]
pub struct Absorbed {
    /// The state changes, encoded as one row of the subscriber's state log (`None`: none).
    pub(crate) log_row: Option<Vec<u8>>,
    pub(crate) outbox: Vec<OutboxMessage>,
}

/// A reader over nothing: for handlers run outside the ledger (e.g. `handler check`).
#[derive(Debug, Default)]
pub struct EmptyState;

impl StateReader for EmptyState {
    fn get(&self, _key: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn scan(&self, _prefix: &[u8], _limit: usize) -> Vec<StateEntry> {
        Vec::new()
    }
    fn unique_exists(&self, _mark: &[u8]) -> bool {
        false
    }
    fn version(&self, _key: &str) -> Option<u64> {
        None
    }
    fn absorb(&mut self, _effects: Effects) {}
    fn finish(self: Box<Self>) -> Absorbed {
        Absorbed::default()
    }
}

/// Why a handler call failed, and what the engine does about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The handler asked to be retried.
    #[error("handler returned a retryable error: {0}")]
    Retryable(String),
    /// The handler said retrying cannot help.
    #[error("handler returned a permanent error: {0}")]
    Permanent(String),
    /// The per-message CPU budget ran out.
    #[error("handler exceeded its CPU budget of {budget_ms} ms")]
    Timeout { budget_ms: u64 },
    /// The instance tried to grow memory past its cap.
    #[error("handler exceeded its memory cap of {cap_mib} MiB")]
    MemoryLimit { cap_mib: u64 },
    /// The guest trapped (panic, unreachable, out-of-bounds access...).
    #[error("handler trapped: {0}")]
    Trap(String),
    /// Not called: the subscriber's circuit breaker on this shard is open, since its
    /// handler failed `failures` calls in a row in the sandbox (trap, CPU budget, memory
    /// cap). The attempt is used up without a call and the message waits until the
    /// breaker lets a call through again, in `retry_in_ms`.
    #[error("handler not called: circuit open after {failures} failed calls in a row (the last: {last}); next call in {retry_in_ms} ms")]
    CircuitOpen {
        failures: u32,
        last: String,
        retry_in_ms: u64,
    },
}

impl Failure {
    /// Retryable failures are retried with backoff up to the subscriber's attempt limit;
    /// the rest are dead-lettered at once.
    pub(crate) fn is_retryable(&self) -> bool {
        !matches!(self, Failure::Permanent(_))
    }

    /// A short, stable name for metrics and dead-letter records.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Failure::Retryable(_) => "retryable",
            Failure::Permanent(_) => "permanent",
            Failure::Timeout { .. } => "timeout",
            Failure::MemoryLimit { .. } => "memory",
            Failure::Trap(_) => "trap",
            Failure::CircuitOpen { .. } => "circuit_open",
        }
    }
}

/// A handler instance bound to one shard thread.
pub trait MessageHandler: Send {
    /// Runs the handler. `state` is moved in for the call and handed back with the result.
    fn handle(
        &mut self,
        msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>);
}

/// Creates handler instances for shard threads; one per subscriber and handler version.
pub trait HandlerFactory: Send + Sync + std::fmt::Debug {
    fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String>;
    /// Recorded in every claim this handler processes.
    fn version(&self) -> u64;
}
