//! Micro-benchmarks of the per-message hot path pieces, with fixed seeds.
//! `cargo bench --bench hot_path`. The end-to-end figure is `dedupd bench` (and, for a
//! Kafka record's way to its shard, `dedupd kafka-bench`).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dedupd::envelope::{canonical_payload, fingerprint, key_hash, pick};
use dedupd::ledger::claims::filter::GenFilter;
use dedupd::ledger::claims::record::{ClaimRecord, LogRow};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const SEED: u64 = 42;

fn keys_and_fingerprints(c: &mut Criterion) {
    let id = "3f2a9c1e-77b0-4d1a-9e0f-0a1b2c3d4e5f";
    let payload =
        br#"{"amount_cents":1999,"currency":"EUR","order":"o-123456","qty":2,"sku":"SKU-00042"}"#;
    let mut g = c.benchmark_group("envelope");
    g.throughput(Throughput::Elements(1));
    g.bench_function("key_hash_36B_id", |b| {
        b.iter(|| key_hash(black_box(id.as_bytes())))
    });
    g.bench_function("fingerprint_90B_payload", |b| {
        b.iter(|| fingerprint(black_box(payload)))
    });
    let value: serde_json::Value = serde_json::from_slice(payload).expect("json");
    g.bench_function("canonical_payload_90B", |b| {
        b.iter(|| canonical_payload(black_box(&value)))
    });
    // A `json_pointer` partition key on `dedupd bench`'s OrderPlaced payload: the whole
    // document as a `Value` (before) and only the member the pointer names.
    let order =
        br#"{"amount_cents":18420,"currency":"EUR","order_id":"o-9f3a2c1e77b04d1a","qty":3,"sku":"SKU-01234","type":"OrderPlaced"}"#;
    g.bench_function("order_id_full_parse_116B", |b| {
        b.iter(|| {
            let v: serde_json::Value = serde_json::from_slice(black_box(order)).expect("json");
            v.pointer("/order_id").map(|id| id.as_str().map(str::len))
        })
    });
    g.bench_function("order_id_pick_116B", |b| {
        b.iter(|| {
            let v = pick(black_box(order), ["/order_id"]).expect("json");
            v.pointer("/order_id").map(|id| id.as_str().map(str::len))
        })
    });
    g.finish();
}

fn filters(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(SEED);
    let n = 1 << 19;
    let keys: Vec<u128> = (0..n).map(|_| rng.random()).collect();
    eprintln!("filters: {n} keys per generation, seed {SEED}");
    let f = GenFilter::build(keys.iter().copied());
    let probes: Vec<u128> = (0..4096).map(|_| rng.random()).collect();
    let mut g = c.benchmark_group("filter");
    g.throughput(Throughput::Elements(probes.len() as u64));
    g.bench_function("probe_miss_x4096", |b| {
        b.iter(|| probes.iter().filter(|k| f.may_contain(**k)).count())
    });
    g.bench_function("probe_hit_x4096", |b| {
        b.iter(|| keys[..4096].iter().filter(|k| f.may_contain(**k)).count())
    });
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("build_512k", |b| {
        b.iter(|| GenFilter::build(keys.iter().copied()))
    });
    g.finish();
}

fn log_rows(c: &mut Criterion) {
    let claim = ClaimRecord {
        fingerprint: 1,
        processed_at_ms: 2,
        expires_at_ms: 3,
        handler_version: 0,
    };
    let mut buf = Vec::with_capacity(1 << 20);
    let mut g = c.benchmark_group("log_row");
    g.throughput(Throughput::Elements(4096));
    g.bench_function("push_x4096", |b| {
        b.iter(|| {
            LogRow::start(&mut buf);
            for k in 0..4096u128 {
                LogRow::push(&mut buf, k, &claim);
            }
            buf.len()
        })
    });
    g.finish();
}

/// A Kafka record turned into a routed job, as the consumer thread does for every record
/// (`source/kafka/consumer.rs`, `accept`): the delivery with its header and key copies,
/// the key from a header, the entity from the record key, the job placed on its shard,
/// and the job dropped (which its shard does after the outcome). With the one header
/// `kafka-bench` sends, and with five more of the kind tracing and schema tools add.
fn kafka_record_to_job(c: &mut Criterion) {
    use dedupd::source::delivery::{route, Keying, Target};
    use dedupd::source::kafka::keying::{delivery, raw_header_key_hash};
    use dedupd::source::kafka::RecordView;

    let dir = tempfile::tempdir().expect("a scratch directory");
    let config = dedupd::config::Config::parse(
        "[ledger]\nshards = 2\n[[subscriber]]\nname = \"orders\"\n\
         key = { source = \"header\", name = \"message-id\" }\n\
         partition_key = { source = \"envelope_key\" }\n",
    )
    .expect("config");
    let ledger = dedupd::ledger::Ledger::open(
        dir.path(),
        &config,
        std::sync::Arc::new(dedupd::clock::SystemClock),
    )
    .expect("ledger");
    let sub = ledger.subscriber("orders").expect("subscriber");
    let (ack, _acks) = crossbeam_channel::unbounded();
    let payload = br#"{"order_id":"o-1234567","sku":"sku-42","qty":3,"price":"19.90"}"#;
    let id = b"3f2a9c1e-77b0-4d1a-9e0f-0a1b2c3d4e5f";
    let extra: [(&str, &[u8]); 5] = [
        (
            "traceparent",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("content-type", b"application/json"),
        ("schema-version", b"7"),
        ("producer", b"checkout-service"),
        ("tenant", b"eu-west"),
    ];
    let mut g = c.benchmark_group("kafka_record");
    g.throughput(Throughput::Elements(1));
    for more in [0, extra.len()] {
        let mut headers: Vec<(&str, &[u8])> = vec![("message-id", id)];
        headers.extend_from_slice(&extra[..more]);
        let view = RecordView {
            key: Some(b"o-1234567"),
            payload,
            headers: &headers,
        };
        g.bench_function(format!("to_job_{}_headers", headers.len()), |b| {
            b.iter(|| {
                let d = delivery(&view, Target::Resolved(sub.clone()));
                let raw = |env: &dedupd::envelope::Envelope,
                           s: &dedupd::config::SubscriberSettings| {
                    raw_header_key_hash(&view, env, s)
                };
                let routed = route(&ledger, d, Keying::DeriveThen(&raw), ack.clone())
                    .expect("a keyed record");
                assert_eq!(routed.job.headers.len(), headers.len());
                black_box(routed.shard)
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    keys_and_fingerprints,
    filters,
    log_rows,
    kafka_record_to_job
);
criterion_main!(benches);
