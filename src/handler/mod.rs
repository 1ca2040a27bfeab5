//! WebAssembly handlers: the only module that imports wasmtime.
//!
//! A [`Component`] is compiled once and pre-instantiated; each shard thread owns its own
//! instance ([`WasmHandler`]) and reuses it across messages (a trapped instance is thrown
//! away and rebuilt). Every call gets a budget (epoch deadline: a ticker thread bumps the
//! engine epoch every millisecond), which also ends the guest's waits on the clock
//! (`clock.rs`: epoch interruption cannot stop a host call), and a memory cap over all of
//! the instance's linear memories (at most [`MAX_MEMORIES`], checked at load). What one
//! call may write through the host is bounded too (`host.rs`, [`Limits`]).
//!
//! What a guest sees of WASI is deterministic per message, so a retry computes what the
//! attempt it replaces computed (G2), and nothing leaves the sandbox:
//!
//! - `wasi:random/*` and `wasi:clocks/wall-clock` are stand-ins (`determinism.rs`): bytes
//!   derived from the subscriber and message id, and the message's received-at;
//! - `wasi:filesystem/*` is linked with no preopened directory, so there is nothing to
//!   open; the environment and arguments are empty; stdin is closed;
//! - `wasi:sockets/*` is linked with every use denied (no TCP, no UDP, no name lookup, no
//!   address passes the check): creating a socket answers `access-denied`.
//!
//! Those last two are linked rather than refused because toolchains other than Rust's
//! (componentize-py's CPython) import them whether the handler uses them or not. Any
//! other interface (`wasi:http`, ...) is refused when the component is loaded, with the
//! import's name. Guest stdout/stderr go to the log, rate-limited.
//!
//! `wasmtime::Error` never leaves this module: traps are classified into
//! [`Failure`] at the edge.

mod clock;
mod determinism;
mod host;
mod output;
mod streams;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, Store, Trap};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::effects::{
    Effects, Failure, HandlerFactory, HandlerMessage, MessageHandler, StateReader,
};
use host::{Finished, HostState};
pub use host::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_KEY, MAX_MEMORIES, MAX_TOPIC, MAX_VALUE};
use output::GuestOutput;

mod bindings {
    wasmtime::component::bindgen!({
        path: "wit/handler.wit",
        world: "dedupd-handler",
        imports: { default: trappable },
    });
}

use bindings::exports::dedupd::handler::handler as guest;

/// How often the epoch ticks; CPU budgets are whole multiples of it.
const EPOCH_TICK: Duration = Duration::from_millis(1);

/// Interfaces a handler may import. Everything else is refused at load. The module docs
/// say what each grants: `wasi:random` and the wall clock are per-message stand-ins, the
/// filesystem has nothing to open and sockets refuse every use.
const ALLOWED_IMPORT_PREFIXES: &[&str] = &[
    "dedupd:handler/host",
    "wasi:io/",
    "wasi:cli/environment",
    "wasi:cli/exit",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-",
    "wasi:clocks/",
    "wasi:random/",
    "wasi:filesystem/",
    "wasi:sockets/",
];

/// Errors of loading or checking a component. Failures of a *call* are
/// [`Failure`]s.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    #[error("cannot read handler {path}: {detail}")]
    Read { path: PathBuf, detail: String },
    #[error("{path} is not a valid WebAssembly component: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error("{path} imports `{import}`, an interface dedupd does not grant to handlers (they get the host interface, and WASI's cli, clocks, io, random, filesystem without directories and sockets that refuse every use; no HTTP or other interfaces)")]
    CapabilityDenied { path: PathBuf, import: String },
    #[error("{path} does not implement the dedupd handler contract (wit/handler.wit): {detail}")]
    Contract { path: PathBuf, detail: String },
    #[error("{path} defines {memories} linear memories; a handler may have at most {limit}")]
    TooManyMemories {
        path: PathBuf,
        memories: usize,
        limit: usize,
    },
    #[error("cannot instantiate handler: {0}")]
    Instantiate(String),
}

/// Per-call limits of a subscriber's handler. The fixed bounds of single host calls
/// (key, value, topic and header sizes) are the `MAX_*` constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Budget per message (rounded up to whole milliseconds): guest CPU and clock waits
    /// together, wall time.
    pub cpu_budget: Duration,
    /// Cap of all linear memories of an instance together.
    pub memory_bytes: usize,
    /// State writes per message: `put`, `delete`, and `compare-and-set`, `insert-unique`,
    /// `advance-version` when they write. Overwrites count.
    pub max_writes: usize,
    /// Bytes of state writes (keys and values) and outbox messages per message.
    pub max_write_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_budget: Duration::from_millis(10),
            memory_bytes: 32 << 20,
            max_writes: 10_000,
            max_write_bytes: 16 << 20,
        }
    }
}

/// The shared engine and its epoch ticker.
struct Runtime {
    engine: Engine,
}

fn runtime() -> Result<&'static Runtime, HandlerError> {
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            let mut config = Config::new();
            config.epoch_interruption(true);
            config.wasm_component_model(true);
            let engine = Engine::new(&config).map_err(|e| e.to_string())?;
            let ticker = engine.weak();
            std::thread::Builder::new()
                .name("dedupd-epoch".into())
                .spawn(move || loop {
                    std::thread::sleep(EPOCH_TICK);
                    match ticker.upgrade() {
                        Some(e) => e.increment_epoch(),
                        None => return,
                    }
                })
                .map_err(|e| e.to_string())?;
            Ok(Runtime { engine })
        })
        .as_ref()
        .map_err(|e| HandlerError::Instantiate(e.clone()))
}

/// What `dedupd handler check` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckReport {
    pub(crate) path: PathBuf,
    pub bytes: usize,
    /// xxh3-64 of the component bytes; recorded in every claim it processes.
    pub(crate) version: String,
    pub(crate) imports: Vec<String>,
    pub exports: Vec<String>,
}

impl std::fmt::Display for CheckReport {
    /// What `dedupd handler check` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        writeln!(
            f,
            "ok: {} ({} bytes, version {})",
            r.path.display(),
            r.bytes,
            r.version
        )?;
        for i in &r.imports {
            writeln!(f, "  import {i}")?;
        }
        for e in &r.exports {
            writeln!(f, "  export {e}")?;
        }
        Ok(())
    }
}

/// What one traced call logged and how its guards answered (see
/// [`WasmHandler::record_calls`]); its writes are in the call's [`Effects`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CallTrace {
    /// `log` host calls in order, then the lines the guest printed on stdout/stderr
    /// (level `stdout`). The engine writes these to its own log.
    pub(crate) logs: Vec<GuestLog>,
    /// `log` calls over the per-call limit of 20 lines, dropped as the engine drops them.
    pub(crate) dropped_logs: u32,
    /// Every guard call and its answer, in order.
    pub(crate) guards: Vec<GuardCall>,
}

/// One line a handler logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GuestLog {
    /// `trace`, `debug`, `info`, `warn`, `error`, or `stdout` for printed output.
    pub(crate) level: &'static str,
    pub(crate) text: String,
}

/// A host call whose answer depends on state: what was asked and what it answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GuardCall {
    /// `insert-unique`: `inserted` is false when the mark existed.
    InsertUnique {
        namespace: String,
        key: String,
        inserted: bool,
    },
    /// `advance-version`: `current` is the version it compared with.
    AdvanceVersion {
        key: String,
        version: u64,
        current: Option<u64>,
        advanced: bool,
    },
    /// `compare-and-set`: `swapped` is false when the value was not the expected one.
    CompareAndSet { key: Vec<u8>, swapped: bool },
}

/// A compiled, validated, pre-instantiated handler component.
pub struct Component {
    path: PathBuf,
    version: u64,
    limits: Limits,
    pre: bindings::DedupdHandlerPre<HostState>,
    report: CheckReport,
}

impl std::fmt::Debug for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Component")
            .field("path", &self.path)
            .field("version", &format_args!("{:016x}", self.version))
            .field("limits", &self.limits)
            .finish()
    }
}

impl Component {
    /// Reads, validates against the WIT contract and the capability allow-list, compiles
    /// and pre-instantiates a component.
    pub fn load(path: &Path, limits: Limits) -> Result<Component, HandlerError> {
        let bytes = std::fs::read(path).map_err(|e| HandlerError::Read {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        Component::from_bytes(path, &bytes, limits)
    }

    /// Like [`Component::load`] for bytes already in memory (`path` names them in errors).
    pub fn from_bytes(
        path: &Path,
        bytes: &[u8],
        limits: Limits,
    ) -> Result<Component, HandlerError> {
        let rt = runtime()?;
        let component = wasmtime::component::Component::new(&rt.engine, bytes).map_err(|e| {
            HandlerError::Invalid {
                path: path.to_path_buf(),
                detail: format!("{e:#}"),
            }
        })?;
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(&rt.engine).map(|(n, _)| n.to_string()).collect();
        let exports: Vec<String> = ty.exports(&rt.engine).map(|(n, _)| n.to_string()).collect();
        if let Some(denied) = imports
            .iter()
            .find(|i| !ALLOWED_IMPORT_PREFIXES.iter().any(|p| i.starts_with(p)))
        {
            return Err(HandlerError::CapabilityDenied {
                path: path.to_path_buf(),
                import: denied.clone(),
            });
        }
        // Unknown (`None`) only for components that import core modules; the store's
        // limiter still refuses the extra memories when such a one is instantiated.
        if let Some(needs) = component.resources_required() {
            let memories = needs.num_memories as usize;
            if memories > MAX_MEMORIES {
                return Err(HandlerError::TooManyMemories {
                    path: path.to_path_buf(),
                    memories,
                    limit: MAX_MEMORIES,
                });
            }
        }
        let mut linker: Linker<HostState> = Linker::new(&rt.engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| HandlerError::Instantiate(format!("linking WASI: {e:#}")))?;
        // The monotonic clock is ours: its waits end with the call's budget (`clock.rs`).
        linker.allow_shadowing(true);
        wasmtime_wasi::p2::bindings::clocks::monotonic_clock::add_to_linker::<_, HasSelf<_>>(
            &mut linker,
            |s| s,
        )
        .map_err(|e| HandlerError::Instantiate(format!("linking the clock: {e:#}")))?;
        // Random bytes and the wall clock are the same on every attempt of a message
        // (`determinism.rs`).
        link_deterministic(&mut linker)?;
        // Stream calls without a Tokio runtime in between (`streams.rs`).
        wasmtime_wasi::p2::bindings::sync::io::streams::add_to_linker::<_, streams::HasStreams>(
            &mut linker,
            |s| streams::Streams(&mut s.table),
        )
        .map_err(|e| HandlerError::Instantiate(format!("linking streams: {e:#}")))?;
        linker.allow_shadowing(false);
        bindings::DedupdHandler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| HandlerError::Instantiate(format!("linking host: {e:#}")))?;
        let instance_pre =
            linker
                .instantiate_pre(&component)
                .map_err(|e| HandlerError::Contract {
                    path: path.to_path_buf(),
                    detail: format!("{e:#}"),
                })?;
        let pre =
            bindings::DedupdHandlerPre::new(instance_pre).map_err(|e| HandlerError::Contract {
                path: path.to_path_buf(),
                detail: format!("{e:#}"),
            })?;
        let version = xxhash_rust::xxh3::xxh3_64(bytes);
        let report = CheckReport {
            path: path.to_path_buf(),
            bytes: bytes.len(),
            version: format!("{version:016x}"),
            imports,
            exports,
        };
        Ok(Component {
            path: path.to_path_buf(),
            version,
            limits,
            pre,
            report,
        })
    }

    pub fn report(&self) -> &CheckReport {
        &self.report
    }

    /// A handler for one shard thread; it instantiates lazily and rebuilds itself after
    /// a trap (a trapped instance must not be entered again).
    pub fn handler(&self) -> WasmHandler {
        WasmHandler {
            pre: self.pre.clone(),
            output: GuestOutput::new(self.path.display().to_string()),
            limits: self.limits,
            live: None,
            recording: false,
            trace: None,
            input: guest::Message {
                subscriber: String::new(),
                id: String::new(),
                key: None,
                headers: Vec::new(),
                payload: Vec::new(),
                attempt: 0,
                received_at_ms: 0,
            },
        }
    }
}

impl Component {
    /// A handler instantiated now, so an instantiation failure shows here rather than on
    /// the first call.
    pub fn live_handler(&self) -> Result<WasmHandler, HandlerError> {
        let mut h = self.handler();
        h.ensure_live()?;
        Ok(h)
    }
}

impl HandlerFactory for Component {
    fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String> {
        let h = self.live_handler().map_err(|e| e.to_string())?;
        Ok(Box::new(h))
    }

    fn version(&self) -> u64 {
        self.version
    }
}

/// Loads a component for a subscriber, shared by every shard.
pub fn load_factory(path: &Path, limits: Limits) -> Result<Arc<dyn HandlerFactory>, HandlerError> {
    Ok(Arc::new(Component::load(path, limits)?))
}

/// Handler calls of one shard thread.
pub struct WasmHandler {
    pre: bindings::DedupdHandlerPre<HostState>,
    limits: Limits,
    /// Printed output and `log` lines of every instance this handler builds: one rate
    /// budget across rebuilds, so a handler that prints and then traps does not get a
    /// fresh burst with each new instance.
    output: GuestOutput,
    live: Option<(Store<HostState>, bindings::DedupdHandler)>,
    input: guest::Message,
    recording: bool,
    trace: Option<CallTrace>,
}

impl WasmHandler {
    /// Traces every further call (`dedupd handler test`): its log lines and printed
    /// output are kept for [`WasmHandler::take_trace`] instead of going to the engine's
    /// log, and its guard calls are recorded with their answers. The call itself is the
    /// same: same host, limits and results.
    pub(crate) fn record_calls(&mut self) {
        self.recording = true;
    }

    /// The trace of the last call, when recording.
    pub(crate) fn take_trace(&mut self) -> Option<CallTrace> {
        self.trace.take()
    }

    /// Bytes of the instance's linear memories (0 before it is instantiated).
    pub fn memory_bytes(&self) -> usize {
        self.live
            .as_ref()
            .map_or(0, |(store, _)| store.data().limiter.total_bytes())
    }

    fn ensure_live(&mut self) -> Result<(), HandlerError> {
        if self.live.is_some() {
            return Ok(());
        }
        let rt = runtime()?;
        let output = self.output.clone();
        // No preopened directory, no environment, no arguments (the builder's defaults,
        // relied on here), and no network use at all, whatever the defaults become.
        let wasi = WasiCtx::builder()
            .stdout(output.clone())
            .stderr(output.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .socket_addr_check(|_, _| Box::pin(async { false }))
            .build();
        let state = HostState::new(wasi, self.limits, output);
        let mut store = Store::new(&rt.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_epoch_deadline(PARKED);
        let bindings = self
            .pre
            .instantiate(&mut store)
            .map_err(|e| HandlerError::Instantiate(format!("{e:#}")))?;
        self.live = Some((store, bindings));
        Ok(())
    }

    fn budget_ticks(&self) -> u64 {
        // The next tick may come at once; one extra tick keeps the budget a minimum.
        self.limits.cpu_budget.as_millis().max(1) as u64 + 1
    }
}

/// Epoch deadline between calls: nothing runs then.
const PARKED: u64 = u64::MAX / 2;

impl MessageHandler for WasmHandler {
    fn handle(
        &mut self,
        msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
        self.trace = None;
        if let Err(e) = self.ensure_live() {
            return (state, Err(Failure::Trap(e.to_string())));
        }
        let ticks = self.budget_ticks();
        let Some((store, bindings)) = self.live.as_mut() else {
            return (state, Err(Failure::Trap("no instance".into())));
        };
        store.data_mut().recording = self.recording;
        store.data_mut().begin(msg, state);
        store.set_epoch_deadline(ticks);
        // The guest's copy reuses the previous call's buffers: no allocation per call.
        let input = &mut self.input;
        input.subscriber.clone_from(&msg.subscriber);
        input.id.clone_from(&msg.id);
        input.key.clone_from(&msg.key);
        input.headers.clone_from(&msg.headers);
        input.payload.clone_from(&msg.payload);
        input.attempt = msg.attempt;
        input.received_at_ms = msg.received_at_ms;
        let called = bindings
            .dedupd_handler_handler()
            .call_handle(&mut *store, input);
        store.set_epoch_deadline(PARKED);
        let mut end = store.data_mut().finish();
        self.trace = end.trace.take();
        let result = match called {
            // A wait was cut short at the end of the budget: whatever the guest made of
            // that, the call ran out of time.
            Ok(_) if end.out_of_time => Err(timeout(&self.limits)),
            Ok(Ok(())) => Ok(end.effects),
            Ok(Err(guest::HandlerError::Retryable(m))) => Err(Failure::Retryable(m)),
            Ok(Err(guest::HandlerError::Permanent(m))) => Err(Failure::Permanent(m)),
            Err(e) => {
                // A trapped instance may not be entered again: rebuild on the next call.
                self.live = None;
                Err(classify(&e, &end, &self.limits))
            }
        };
        (end.reader, result)
    }
}

fn timeout(limits: &Limits) -> Failure {
    Failure::Timeout {
        budget_ms: limits.cpu_budget.as_millis() as u64,
    }
}

/// Turns a wasmtime error into a typed failure.
fn classify(e: &wasmtime::Error, end: &Finished, limits: &Limits) -> Failure {
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => timeout(limits),
        _ if end.out_of_time => timeout(limits),
        _ if end.memory_denied => Failure::MemoryLimit {
            cap_mib: (limits.memory_bytes >> 20) as u64,
        },
        Some(t) => Failure::Trap(t.to_string()),
        None => Failure::Trap(format!("{e:#}")),
    }
}

/// Shadows wasmtime-wasi's `wasi:random/*` and `wasi:clocks/wall-clock` with the
/// per-message stand-ins of `determinism.rs`.
fn link_deterministic(linker: &mut Linker<HostState>) -> Result<(), HandlerError> {
    use wasmtime_wasi::p2::bindings::{clocks, random};
    let err = |e: wasmtime::Error| HandlerError::Instantiate(format!("linking randomness: {e:#}"));
    random::random::add_to_linker::<_, HasSelf<_>>(linker, |s| s).map_err(err)?;
    random::insecure::add_to_linker::<_, HasSelf<_>>(linker, |s| s).map_err(err)?;
    random::insecure_seed::add_to_linker::<_, HasSelf<_>>(linker, |s| s).map_err(err)?;
    clocks::wall_clock::add_to_linker::<_, HasSelf<_>>(linker, |s| s)
        .map_err(|e| HandlerError::Instantiate(format!("linking the wall clock: {e:#}")))?;
    Ok(())
}

/// Only for the `WasiView` bound of the WASI linker.
impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}
