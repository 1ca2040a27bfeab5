//! Cost of a handler call: a pooled instance (what the engine does) against a fresh
//! instance per message, for `noop` (pure overhead), `shipping-label` (a real handler) and
//! its Python twin `python-shipping-label` (componentize-py). Before the calls it prints
//! each component's size, compile time and memory per instance. Needs the components:
//! `plugins/build.sh` and `plugins/build-python.sh` first. `cargo bench --bench
//! handler_call` (`-- python` for the Python one only).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dedupd::effects::{EmptyState, HandlerMessage, MessageHandler};
use dedupd::handler::{Component, Limits};

fn component(name: &str) -> Component {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("plugins/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    // CPython starts with more memory than the default cap allows a Rust guest.
    let limits = Limits {
        memory_bytes: 64 << 20,
        ..Limits::default()
    };
    let start = Instant::now();
    let c = Component::load(&p, limits)
        .unwrap_or_else(|e| panic!("{e} (run plugins/build.sh and plugins/build-python.sh first)"));
    let compiled = start.elapsed();
    let start = Instant::now();
    let h = c.live_handler().unwrap_or_else(|e| panic!("{name}: {e}"));
    println!(
        "{name}: {} bytes, compiled in {compiled:.2?}, instantiated in {:.2?}, {} KiB of linear memory per instance",
        c.report().bytes,
        start.elapsed(),
        h.memory_bytes() >> 10
    );
    c
}

fn message() -> HandlerMessage {
    HandlerMessage {
        subscriber: "bench".into(),
        id: "3f2a9c1e-77b0-4d1a-9e0f-0a1b2c3d4e5f".into(),
        key_hash: dedupd::envelope::key_hash(b"3f2a9c1e-77b0-4d1a-9e0f-0a1b2c3d4e5f"),
        key: None,
        headers: vec![],
        payload: br#"{"amount_cents":1999,"currency":"EUR","order_id":"o-123456","qty":2,"sku":"SKU-00042","type":"OrderPlaced"}"#.to_vec(),
        attempt: 1,
        received_at_ms: 1_700_000_000_000,
    }
}

fn calls(c: &mut Criterion) {
    let msg = message();
    let mut g = c.benchmark_group("handler_call");
    g.throughput(Throughput::Elements(1));
    for name in ["noop", "shipping_label", "python_shipping_label"] {
        let comp = component(name);
        let mut pooled = comp.handler();
        let mut state: Option<Box<dyn dedupd::effects::StateReader>> = Some(Box::new(EmptyState));
        g.bench_function(format!("{name}/pooled"), |b| {
            b.iter(|| {
                let (s, r) = pooled.handle(
                    black_box(&msg),
                    state.take().unwrap_or_else(|| Box::new(EmptyState)),
                );
                state = Some(s);
                r
            })
        });
        g.bench_function(format!("{name}/instance_per_message"), |b| {
            b.iter(|| {
                let mut fresh = comp.handler();
                fresh.handle(black_box(&msg), Box::new(EmptyState)).1
            })
        });
    }
    g.finish();
}

criterion_group!(benches, calls);
criterion_main!(benches);
