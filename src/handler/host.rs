//! The host side of `dedupd:handler/host`: state access with read-your-writes, business
//! uniqueness, version guards, the outbox, operation keys, logging.
//!
//! Every write goes into the call's [`Effects`]; nothing touches storage here. The ledger
//! applies the effects with the claim (G2) or drops them when the call fails (G6). What a
//! call may buffer is bounded, each write and in total (see [`Limits`]): the effects live in
//! host memory until the batch commits, outside the guest's memory cap. A call over a bound
//! traps: it is a bug in the handler, not a reason to wait.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::WasiCtx;
use xxhash_rust::xxh3::xxh3_128;

use super::bindings::dedupd::handler::host::{self, Entry, Level};
use super::clock::CallClock;
use super::determinism::CallEntropy;
use super::output::GuestOutput;
use super::{CallTrace, GuardCall, GuestLog, Limits};
use crate::effects::{unique_key, Effects, EmptyState, HandlerMessage, OutboxMessage, StateReader};

/// Largest key and value a handler may store (an outbox message's key and payload too);
/// more is a trap (a bug, not a retry).
pub const MAX_KEY: usize = 1024;
pub const MAX_VALUE: usize = 1 << 20;
const MAX_SCAN: usize = 1000;
pub(crate) const MAX_EMITS: usize = 1000;
/// Longest outbox topic name (Kafka's limit).
pub const MAX_TOPIC: usize = 249;
/// Headers of one outbox message: how many, and their names and values together.
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Linear memories of one instance; [`Limits::memory_bytes`] caps them together.
pub const MAX_MEMORIES: usize = 4;
/// Log lines a single call may write; the rest are counted and dropped.
const MAX_LOG_LINES: u32 = 20;

/// Caps the linear memories of an instance together (a component may define several;
/// each one under the cap would multiply it) and remembers whether a growth was refused,
/// so the resulting trap can be reported as a memory failure.
pub(crate) struct MemoryCap {
    cap: usize,
    /// Bytes of all memories of the instance, as granted.
    total: usize,
    /// The last granted change (from, to), undone if the growth then failed.
    pending: Option<(usize, usize)>,
    pub(crate) denied: bool,
}

impl MemoryCap {
    pub(crate) fn new(cap: usize) -> Self {
        MemoryCap {
            cap,
            total: 0,
            pending: None,
            denied: false,
        }
    }

    /// The cap of all memories together, in bytes.
    pub(crate) fn cap_bytes(&self) -> usize {
        self.cap
    }

    /// Bytes of all memories of the instance now.
    pub(crate) fn total_bytes(&self) -> usize {
        self.total
    }
}

impl wasmtime::ResourceLimiter for MemoryCap {
    /// Also called when a memory is created (`current` 0).
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.total.saturating_sub(current).saturating_add(desired);
        if total > self.cap {
            self.denied = true;
            return Ok(false);
        }
        self.total = total;
        self.pending = Some((current, desired));
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        if let Some((from, to)) = self.pending.take() {
            self.total = self.total.saturating_sub(to).saturating_add(from);
        }
        Ok(())
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }

    fn instances(&self) -> usize {
        32
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}

/// The message being handled. Its buffers are reused from call to call.
#[derive(Default)]
struct Call {
    subscriber: String,
    id: String,
    /// The id text is the message's identity: the key hash is the hash of exactly these
    /// bytes (see [`HostState::seed`]).
    id_is_identity: bool,
    /// The idempotency key's hash: what the claim is stored under.
    key_hash: u128,
    received_at_ms: u64,
    emits: usize,
    /// State writes so far (see [`Limits::max_writes`]).
    writes: usize,
    /// Bytes of state and outbox writes so far (see [`Limits::max_write_bytes`]).
    write_bytes: usize,
    logs: u32,
}

/// Store data of one handler instance.
pub(crate) struct HostState {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    pub(crate) limiter: MemoryCap,
    /// The guest's monotonic clock and the running call's wait deadline (`clock.rs`).
    pub(crate) clock: Arc<CallClock>,
    /// The call's random stream and wall clock (`determinism.rs`).
    pub(crate) entropy: CallEntropy,
    limits: Limits,
    output: GuestOutput,
    call: Call,
    /// Whether a call is running (`begin` .. `finish`).
    in_call: bool,
    reader: Box<dyn StateReader>,
    effects: Effects,
    /// Whether calls are traced (`dedupd handler test`): logs and guard answers are kept
    /// in `trace` instead of (logs) or besides (guards) going to the engine's log.
    pub(crate) recording: bool,
    trace: Option<CallTrace>,
}

impl HostState {
    pub(crate) fn new(wasi: WasiCtx, limits: Limits, output: GuestOutput) -> Self {
        HostState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryCap::new(limits.memory_bytes),
            clock: CallClock::new(),
            entropy: CallEntropy::default(),
            limits,
            output,
            call: Call::default(),
            in_call: false,
            reader: Box::new(EmptyState),
            effects: Effects::default(),
            recording: false,
            trace: None,
        }
    }

    /// Prepares a call: the message context and the state it reads.
    pub(crate) fn begin(&mut self, msg: &HandlerMessage, reader: Box<dyn StateReader>) {
        self.reader = reader;
        self.effects = Effects::default();
        self.limiter.denied = false;
        self.clock.start(self.limits.cpu_budget);
        // Reuses the previous call's strings: no allocation per call.
        let call = &mut self.call;
        call.subscriber.clone_from(&msg.subscriber);
        call.id.clone_from(&msg.id);
        call.key_hash = msg.key_hash;
        call.id_is_identity = crate::envelope::key_hash(msg.id.as_bytes()) == msg.key_hash;
        call.received_at_ms = msg.received_at_ms;
        call.emits = 0;
        call.writes = 0;
        call.write_bytes = 0;
        call.logs = 0;
        self.trace = self.recording.then(CallTrace::default);
        self.in_call = true;
        let seed = self.seed("random", "").unwrap_or_default();
        self.entropy.start(seed, msg.received_at_ms);
    }

    /// Ends a call: hands back the reader, the effects and what ran out.
    pub(crate) fn finish(&mut self) -> Finished {
        // Whatever runs before the next call (a rebuild after a trap) reads the stream
        // of no message, not the rest of this one's.
        self.entropy.end();
        if std::mem::take(&mut self.in_call) {
            match self.trace.as_mut() {
                Some(trace) => {
                    trace
                        .logs
                        .extend(self.output.take_lines().into_iter().map(|text| GuestLog {
                            level: "stdout",
                            text,
                        }))
                }
                None => self.output.flush_to_log(&self.call.subscriber),
            }
        }
        Finished {
            trace: self.trace.take(),
            reader: std::mem::replace(&mut self.reader, Box::new(EmptyState)),
            effects: std::mem::take(&mut self.effects),
            memory_denied: self.limiter.denied,
            out_of_time: self.clock.stop(),
        }
    }

    /// Counts one state write of `bytes` against the call's bounds.
    fn charge_write(&mut self, bytes: usize) -> wasmtime::Result<()> {
        let max = self.limits.max_writes;
        let call = self.call_mut()?;
        call.writes += 1;
        if call.writes > max {
            wasmtime::bail!("more than {max} state writes in one message (handler_max_writes)");
        }
        self.charge_bytes(bytes)
    }

    /// Counts `bytes` of state or outbox writes against the call's bound.
    fn charge_bytes(&mut self, bytes: usize) -> wasmtime::Result<()> {
        let max = self.limits.max_write_bytes;
        let call = self.call_mut()?;
        call.write_bytes = call.write_bytes.saturating_add(bytes);
        if call.write_bytes > max {
            wasmtime::bail!(
                "more than {max} bytes of state and outbox writes in one message (handler_max_write_mib)"
            );
        }
        Ok(())
    }

    fn call(&self) -> wasmtime::Result<&Call> {
        match self.in_call {
            true => Ok(&self.call),
            false => Err(wasmtime::Error::msg("host called outside a message")),
        }
    }

    fn call_mut(&mut self) -> wasmtime::Result<&mut Call> {
        match self.in_call {
            true => Ok(&mut self.call),
            false => Err(wasmtime::Error::msg("host called outside a message")),
        }
    }

    /// Read-your-writes: this call's effects first, then the batch's committed view.
    fn read(&self, key: &[u8]) -> Option<Vec<u8>> {
        match self.effects.state.get(key) {
            Some(v) => v.clone(),
            None => self.reader.get(key),
        }
    }

    /// Deterministic per (subscriber, message, purpose).
    fn derive(&self, purpose: &str, name: &str) -> wasmtime::Result<String> {
        Ok(hex128(self.seed(purpose, name)?))
    }

    /// The number behind [`HostState::derive`]'s keys; also seeds the call's random
    /// stream (`determinism.rs`). It hashes a sequence of length-prefixed parts, which
    /// decodes one way only, so two different sequences never share their bytes:
    ///
    /// - `[purpose, subscriber, id text, name]` when the id text is the message's identity
    ///   (its hash is the claim's key: ids from `id`, a UTF-8 header, JSON pointers, HTTP
    ///   `Idempotency-Key`). These are the parts of format 7, so such keys did not change.
    /// - `[purpose, subscriber, "", key hash, name]` otherwise: a CloudEvents id, whose
    ///   text `source#id` two different pairs can share, and a Kafka header id that is not
    ///   UTF-8. Two messages then share derived ids only if they share their claim
    ///   (format 8; before, `("shop#eu", "7")` and `("shop", "eu#7")` did).
    fn seed(&self, purpose: &str, name: &str) -> wasmtime::Result<u128> {
        let call = self.call()?;
        let mut buf = Vec::with_capacity(call.subscriber.len() + call.id.len() + name.len() + 64);
        let mut part = |bytes: &[u8]| {
            buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            buf.extend_from_slice(bytes);
        };
        part(purpose.as_bytes());
        part(call.subscriber.as_bytes());
        if call.id_is_identity {
            part(call.id.as_bytes());
        } else {
            part(b"");
            part(&call.key_hash.to_le_bytes());
        }
        part(name.as_bytes());
        Ok(xxh3_128(&buf))
    }
}

impl HostState {
    /// Records a guard's answer when calls are traced.
    fn traced(&mut self, call: impl FnOnce() -> GuardCall) {
        if let Some(trace) = self.trace.as_mut() {
            trace.guards.push(call());
        }
    }
}

/// The name of a log level, as `dedupd handler test` prints it.
fn level_name(level: Level) -> &'static str {
    match level {
        Level::Trace => "trace",
        Level::Debug => "debug",
        Level::Info => "info",
        Level::Warn => "warn",
        Level::Error => "error",
    }
}

/// What a call left behind, from [`HostState::finish`].
pub(crate) struct Finished {
    pub(crate) reader: Box<dyn StateReader>,
    pub(crate) effects: Effects,
    /// A memory growth was refused.
    pub(crate) memory_denied: bool,
    /// A wait reached the end of the budget (`clock.rs`).
    pub(crate) out_of_time: bool,
    /// What the call logged and how its guards answered, when recording.
    pub(crate) trace: Option<CallTrace>,
}

/// `format!("{:032x}")` without the formatting machinery (2 % of a shipping-label run's
/// CPU went to `derive`, most of it in `fmt`).
fn hex128(x: u128) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(32);
    for b in x.to_be_bytes() {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

fn check_key(key: &[u8]) -> wasmtime::Result<()> {
    if key.is_empty() || key.len() > MAX_KEY {
        wasmtime::bail!("state key of {} bytes (must be 1..={MAX_KEY})", key.len());
    }
    Ok(())
}

fn check_value(value: &[u8]) -> wasmtime::Result<()> {
    if value.len() > MAX_VALUE {
        wasmtime::bail!("state value of {} bytes (limit {MAX_VALUE})", value.len());
    }
    Ok(())
}

/// Checks an outbox message; returns its size in bytes.
fn check_emit(
    topic: &str,
    key: Option<&str>,
    headers: &[(String, String)],
    payload: &[u8],
) -> wasmtime::Result<usize> {
    if topic.is_empty() || topic.len() > MAX_TOPIC {
        wasmtime::bail!(
            "outbox topic of {} bytes (must be 1..={MAX_TOPIC})",
            topic.len()
        );
    }
    let key_len = key.map_or(0, str::len);
    if key_len > MAX_KEY {
        wasmtime::bail!("outbox key of {key_len} bytes (limit {MAX_KEY})");
    }
    if headers.len() > MAX_HEADERS {
        wasmtime::bail!(
            "outbox message with {} headers (limit {MAX_HEADERS})",
            headers.len()
        );
    }
    let header_bytes: usize = headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if header_bytes > MAX_HEADER_BYTES {
        wasmtime::bail!("outbox headers of {header_bytes} bytes (limit {MAX_HEADER_BYTES})");
    }
    if payload.len() > MAX_VALUE {
        wasmtime::bail!(
            "outbox payload of {} bytes (limit {MAX_VALUE})",
            payload.len()
        );
    }
    Ok(topic.len() + key_len + header_bytes + payload.len())
}

impl host::Host for HostState {
    fn log(&mut self, level: Level, text: String) -> wasmtime::Result<()> {
        let call = self.call_mut()?;
        call.logs += 1;
        let over = call.logs > MAX_LOG_LINES;
        if let Some(trace) = self.trace.as_mut() {
            match over {
                true => trace.dropped_logs += 1,
                false => trace.logs.push(GuestLog {
                    level: level_name(level),
                    text,
                }),
            }
            return Ok(());
        }
        // Over the per-call cap, or over the instance's lines per second (shared with
        // printed output): dropped, and counted in the output's next notice.
        if over || !self.output.admit_log_line() {
            return Ok(());
        }
        let call = self.call()?;
        let (sub, id) = (&call.subscriber, &call.id);
        match level {
            Level::Trace => tracing::trace!(subscriber = %sub, id = %id, "{text}"),
            Level::Debug => tracing::debug!(subscriber = %sub, id = %id, "{text}"),
            Level::Info => tracing::info!(subscriber = %sub, id = %id, "{text}"),
            Level::Warn => tracing::warn!(subscriber = %sub, id = %id, "{text}"),
            Level::Error => tracing::error!(subscriber = %sub, id = %id, "{text}"),
        }
        Ok(())
    }

    fn get(&mut self, key: Vec<u8>) -> wasmtime::Result<Option<Vec<u8>>> {
        check_key(&key)?;
        Ok(self.read(&key))
    }

    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) -> wasmtime::Result<()> {
        check_key(&key)?;
        check_value(&value)?;
        self.charge_write(key.len() + value.len())?;
        self.effects.state.insert(key, Some(value));
        Ok(())
    }

    fn delete(&mut self, key: Vec<u8>) -> wasmtime::Result<()> {
        check_key(&key)?;
        self.charge_write(key.len())?;
        self.effects.state.insert(key, None);
        Ok(())
    }

    fn scan(&mut self, prefix: Vec<u8>, limit: u32) -> wasmtime::Result<Vec<Entry>> {
        let limit = (limit as usize).min(MAX_SCAN);
        // Committed entries overlaid with this call's writes, in key order.
        let mut merged: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = self
            .reader
            .scan(&prefix, limit + self.effects.state.len())
            .into_iter()
            .collect();
        for (k, v) in self.effects.state.range(prefix.clone()..) {
            if !k.starts_with(&prefix) {
                break;
            }
            match v {
                Some(v) => merged.insert(k.clone(), v.clone()),
                None => merged.remove(k),
            };
        }
        Ok(merged
            .into_iter()
            .take(limit)
            .map(|(key, value)| Entry { key, value })
            .collect())
    }

    fn insert_unique(&mut self, namespace: String, key: String) -> wasmtime::Result<bool> {
        if namespace.is_empty() || namespace.contains('\0') {
            wasmtime::bail!("uniqueness namespace must be non-empty and free of NUL bytes");
        }
        if namespace.len() + key.len() > MAX_KEY {
            wasmtime::bail!(
                "unique key of {} bytes (limit {MAX_KEY})",
                namespace.len() + key.len()
            );
        }
        let mark = unique_key(&namespace, &key);
        let inserted = !(self.effects.uniques.contains(&mark) || self.reader.unique_exists(&mark));
        if inserted {
            self.charge_write(mark.len())?;
            self.effects.uniques.insert(mark);
        }
        self.traced(|| GuardCall::InsertUnique {
            namespace,
            key,
            inserted,
        });
        Ok(inserted)
    }

    fn advance_version(&mut self, key: String, version: u64) -> wasmtime::Result<bool> {
        if key.is_empty() || key.len() > MAX_KEY {
            wasmtime::bail!("version key of {} bytes (must be 1..={MAX_KEY})", key.len());
        }
        let current = match self.effects.versions.get(&key) {
            Some(v) => Some(*v),
            None => self.reader.version(&key),
        };
        let advanced = current.is_none_or(|c| version > c);
        if advanced {
            self.charge_write(key.len() + 8)?;
        }
        // Only a traced call pays for the key's copy.
        let traced = self.trace.is_some().then(|| key.clone());
        if advanced {
            self.effects.versions.insert(key, version);
        }
        if let Some(key) = traced {
            self.traced(|| GuardCall::AdvanceVersion {
                key,
                version,
                current,
                advanced,
            });
        }
        Ok(advanced)
    }

    fn compare_and_set(
        &mut self,
        key: Vec<u8>,
        expected: Option<Vec<u8>>,
        new: Vec<u8>,
    ) -> wasmtime::Result<bool> {
        check_key(&key)?;
        check_value(&new)?;
        let swapped = self.read(&key) == expected;
        if swapped {
            self.charge_write(key.len() + new.len())?;
        }
        // Only a traced call pays for the key's copy.
        let traced = self.trace.is_some().then(|| key.clone());
        if swapped {
            self.effects.state.insert(key, Some(new));
        }
        if let Some(key) = traced {
            self.traced(|| GuardCall::CompareAndSet { key, swapped });
        }
        Ok(swapped)
    }

    fn emit(
        &mut self,
        topic: String,
        key: Option<String>,
        headers: Vec<(String, String)>,
        payload: Vec<u8>,
    ) -> wasmtime::Result<String> {
        let n = {
            let call = self.call_mut()?;
            call.emits += 1;
            call.emits
        };
        if n > MAX_EMITS {
            wasmtime::bail!("more than {MAX_EMITS} emits in one message");
        }
        let bytes = check_emit(&topic, key.as_deref(), &headers, &payload)?;
        self.charge_bytes(bytes)?;
        let id = self.derive("emit", &n.to_string())?;
        self.effects.outbox.push(OutboxMessage {
            id: id.clone(),
            topic,
            key,
            headers,
            payload,
            changelog_partition: None,
        });
        Ok(id)
    }

    fn operation_key(&mut self, name: String) -> wasmtime::Result<String> {
        self.derive("operation", &name)
    }

    fn now_ms(&mut self) -> wasmtime::Result<u64> {
        Ok(self.call()?.received_at_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::MemoryCap;
    use wasmtime::ResourceLimiter;

    const MIB: usize = 1 << 20;

    #[test]
    fn memory_cap_over_all_memories_obeyed() {
        let mut cap = MemoryCap::new(4 * MIB);
        assert!(cap.memory_growing(0, 3 * MIB, None).unwrap());
        assert!(cap.memory_growing(0, MIB, None).unwrap());
        assert!(!cap.denied);
    }

    #[test]
    fn memory_cap_over_all_memories_violated() {
        // Each memory alone is under the cap; together they are not.
        let mut cap = MemoryCap::new(4 * MIB);
        assert!(cap.memory_growing(0, 3 * MIB, None).unwrap());
        assert!(!cap.memory_growing(0, 2 * MIB, None).unwrap());
        assert!(cap.denied);
        // Growing the first memory counts only the difference.
        let mut cap = MemoryCap::new(4 * MIB);
        assert!(cap.memory_growing(0, 2 * MIB, None).unwrap());
        assert!(cap.memory_growing(2 * MIB, 4 * MIB, None).unwrap());
        assert!(!cap.memory_growing(4 * MIB, 5 * MIB, None).unwrap());
    }

    #[test]
    fn failed_growth_gives_its_bytes_back() {
        let mut cap = MemoryCap::new(4 * MIB);
        assert!(cap.memory_growing(0, MIB, None).unwrap());
        assert!(cap.memory_growing(MIB, 4 * MIB, None).unwrap());
        cap.memory_grow_failed(wasmtime::Error::msg("above the memory's maximum"))
            .unwrap();
        assert!(cap.memory_growing(0, 3 * MIB, None).unwrap());
    }

    #[test]
    fn memory_count_is_bounded() {
        assert_eq!(MemoryCap::new(MIB).memories(), super::MAX_MEMORIES);
    }

    #[test]
    fn hex128_matches_the_formatter() {
        for x in [
            0u128,
            1,
            0xabc,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            assert_eq!(super::hex128(x), format!("{x:032x}"));
        }
    }
}
