//! The host side of `dedupd:handler/host`: state access with read-your-writes, business
//! uniqueness, version guards, the outbox, operation keys, logging.
//!
//! Every write goes into the call's [`Effects`]; nothing touches storage here. The ledger
//! applies the effects with the claim (G2) or drops them when the call fails (G6).

use wasmtime::component::ResourceTable;
use wasmtime_wasi::WasiCtx;
use xxhash_rust::xxh3::xxh3_128;

use super::bindings::dedupd::handler::host::{self, Entry, Level};
use super::output::GuestOutput;
use crate::effects::{unique_key, Effects, EmptyState, HandlerMessage, OutboxMessage, StateReader};

/// Largest key and value a handler may store; more is a trap (a bug, not a retry).
const MAX_KEY: usize = 1024;
const MAX_VALUE: usize = 1 << 20;
const MAX_SCAN: usize = 1000;
const MAX_EMITS: usize = 1000;
/// Log lines a single call may write; the rest are counted and dropped.
const MAX_LOG_LINES: u32 = 20;

/// Caps linear memory and remembers whether a growth was refused, so the resulting trap
/// can be reported as a memory failure.
pub(crate) struct MemoryCap {
    cap: usize,
    pub denied: bool,
}

impl MemoryCap {
    pub fn new(cap: usize) -> Self {
        MemoryCap { cap, denied: false }
    }
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap {
            self.denied = true;
            return Ok(false);
        }
        Ok(true)
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
        32
    }
}

/// The message being handled. Its buffers are reused from call to call.
#[derive(Default)]
struct Call {
    subscriber: String,
    id: String,
    received_at_ms: u64,
    emits: usize,
    logs: u32,
}

/// Store data of one handler instance.
pub(crate) struct HostState {
    pub wasi: WasiCtx,
    pub table: ResourceTable,
    pub limiter: MemoryCap,
    output: GuestOutput,
    call: Call,
    /// Whether a call is running (`begin` .. `finish`).
    in_call: bool,
    reader: Box<dyn StateReader>,
    effects: Effects,
}

impl HostState {
    pub fn new(wasi: WasiCtx, limiter: MemoryCap, output: GuestOutput) -> Self {
        HostState {
            wasi,
            table: ResourceTable::new(),
            limiter,
            output,
            call: Call::default(),
            in_call: false,
            reader: Box::new(EmptyState),
            effects: Effects::default(),
        }
    }

    /// Prepares a call: the message context and the state it reads.
    pub fn begin(&mut self, msg: &HandlerMessage, reader: Box<dyn StateReader>) {
        self.reader = reader;
        self.effects = Effects::default();
        self.limiter.denied = false;
        // Reuses the previous call's strings: no allocation per call.
        let call = &mut self.call;
        call.subscriber.clone_from(&msg.subscriber);
        call.id.clone_from(&msg.id);
        call.received_at_ms = msg.received_at_ms;
        call.emits = 0;
        call.logs = 0;
        self.in_call = true;
    }

    /// Ends a call: hands back the reader, the effects and whether memory was refused.
    pub fn finish(&mut self) -> (Box<dyn StateReader>, Effects, bool) {
        if std::mem::take(&mut self.in_call) {
            self.output.flush_to_log(&self.call.subscriber);
        }
        let reader = std::mem::replace(&mut self.reader, Box::new(EmptyState));
        (
            reader,
            std::mem::take(&mut self.effects),
            self.limiter.denied,
        )
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

    /// Deterministic per (subscriber, message id, purpose).
    fn derive(&self, purpose: &str, name: &str) -> wasmtime::Result<String> {
        let call = self.call()?;
        let mut buf = Vec::with_capacity(call.subscriber.len() + call.id.len() + name.len() + 32);
        for part in [purpose, &call.subscriber, &call.id, name] {
            buf.extend_from_slice(&(part.len() as u64).to_le_bytes());
            buf.extend_from_slice(part.as_bytes());
        }
        Ok(hex128(xxh3_128(&buf)))
    }
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

impl host::Host for HostState {
    fn log(&mut self, level: Level, text: String) -> wasmtime::Result<()> {
        let call = self.call_mut()?;
        call.logs += 1;
        if call.logs > MAX_LOG_LINES {
            return Ok(());
        }
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
        if value.len() > MAX_VALUE {
            wasmtime::bail!("state value of {} bytes (limit {MAX_VALUE})", value.len());
        }
        self.effects.state.insert(key, Some(value));
        Ok(())
    }

    fn delete(&mut self, key: Vec<u8>) -> wasmtime::Result<()> {
        check_key(&key)?;
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
        if self.effects.uniques.contains(&mark) || self.reader.unique_exists(&mark) {
            return Ok(false);
        }
        self.effects.uniques.insert(mark);
        Ok(true)
    }

    fn advance_version(&mut self, key: String, version: u64) -> wasmtime::Result<bool> {
        if key.is_empty() || key.len() > MAX_KEY {
            wasmtime::bail!("version key of {} bytes (must be 1..={MAX_KEY})", key.len());
        }
        let current = match self.effects.versions.get(&key) {
            Some(v) => Some(*v),
            None => self.reader.version(&key),
        };
        if current.is_some_and(|c| version <= c) {
            return Ok(false);
        }
        self.effects.versions.insert(key, version);
        Ok(true)
    }

    fn compare_and_set(
        &mut self,
        key: Vec<u8>,
        expected: Option<Vec<u8>>,
        new: Vec<u8>,
    ) -> wasmtime::Result<bool> {
        check_key(&key)?;
        if self.read(&key) != expected {
            return Ok(false);
        }
        self.effects.state.insert(key, Some(new));
        Ok(true)
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
        let id = self.derive("emit", &n.to_string())?;
        self.effects.outbox.push(OutboxMessage {
            id: id.clone(),
            topic,
            key,
            headers,
            payload,
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
