//! The Kafka source against librdkafka's mock cluster (or a real cluster when
//! `KAFKA_BOOTSTRAP` is set): crash redelivery with the real binary, rebalance between two
//! engines, dead-letter and outbox topics, poison messages, a stop after the broker went away.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::pipeline::{Cause, Shutdown};
use dedupd::source::kafka::{
    self, DevBroker, KafkaConfig, RunOptions, SourceStats, SubscriptionConfig,
};

use common::broker::start_source;
use common::component;

/// A cluster for one test: the mock broker, or the one `KAFKA_BOOTSTRAP` names.
struct Cluster {
    _mock: Option<DevBroker>,
    bootstrap: String,
}

fn cluster() -> Cluster {
    logs();
    match std::env::var("KAFKA_BOOTSTRAP") {
        Ok(b) if !b.is_empty() => Cluster {
            _mock: None,
            bootstrap: b,
        },
        _ => {
            let mock = DevBroker::start(1).unwrap();
            Cluster {
                bootstrap: mock.bootstrap_servers(),
                _mock: Some(mock),
            }
        }
    }
}

impl Cluster {
    /// Creates a topic with `partitions` partitions.
    fn create_topic(&self, topic: &str, partitions: i32) {
        match &self._mock {
            Some(mock) => mock.create_topic(topic, partitions).unwrap(),
            None => {
                use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
                let admin: AdminClient<rdkafka::client::DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", &self.bootstrap)
                    .create()
                    .unwrap();
                let topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(admin.create_topics([&topic], &AdminOptions::new()))
                    .unwrap();
            }
        }
    }
}

/// Topic names unique per run, so a real cluster can be reused.
fn topic(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

struct Rec<'a> {
    key: &'a str,
    headers: Vec<(&'a str, String)>,
    payload: String,
}

fn produce(bootstrap: &str, topic: &str, records: &[Rec<'_>]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .create()
        .unwrap();
    for r in records {
        let mut h = OwnedHeaders::new();
        for (k, v) in &r.headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let rec = BaseRecord::to(topic)
            .key(r.key)
            .payload(r.payload.as_str())
            .headers(h);
        let mut rec = rec;
        loop {
            match producer.send(rec) {
                Ok(()) => break,
                Err((_, back)) => {
                    producer.poll(Duration::from_millis(10));
                    rec = back;
                }
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).unwrap();
}

/// Every message of a topic, read by a fresh group.
fn read_all(bootstrap: &str, topic: &str, want: usize) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("reader-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "3000")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < want && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            out.push(m.detach());
        }
    }
    out
}

/// Every record of `topic` up to its end offsets now, read by assignment (no group, so no
/// rebalance reads a record twice).
fn read_to_end(bootstrap: &str, topic: &str) -> Vec<OwnedMessage> {
    let ends = committed_and_end(bootstrap, "nobody", topic);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "nobody")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..ends.len() as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let want: i64 = ends.iter().map(|(_, end)| end).sum();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (out.len() as i64) < want && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            out.push(m.detach());
        }
    }
    assert_eq!(
        out.len() as i64,
        want,
        "{topic}: every record up to {ends:?}"
    );
    out
}

fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// (committed, log end) per partition of `topic` for `group`.
fn committed_and_end(bootstrap: &str, group: &str, topic: &str) -> Vec<(i64, i64)> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .unwrap();
    let parts = md.topics()[0].partitions().len() as i32;
    let mut tpl = TopicPartitionList::new();
    for p in 0..parts {
        tpl.add_partition(topic, p);
    }
    let committed = c.committed_offsets(tpl, Duration::from_secs(5)).unwrap();
    (0..parts)
        .map(|p| {
            let (_, high) = c
                .fetch_watermarks(topic, p, Duration::from_secs(5))
                .unwrap();
            let off = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            };
            (off, high)
        })
        .collect()
}

/// Sets a stop flag when dropped, so a failed assertion does not leave a source running
/// (and the test hanging) inside a thread scope.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The same for a whole Kafka source.
struct ShutdownOnDrop<'a>(&'a Shutdown);

impl Drop for ShutdownOnDrop<'_> {
    fn drop(&mut self) {
        self.0.trigger(Cause::Requested);
    }
}

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn at_log_end(bootstrap: &str, group: &str, topic: &str) -> bool {
    let ends = committed_and_end(bootstrap, group, topic);
    tracing::debug!(?ends, topic, "committed offsets and log ends");
    ends.iter().all(|(c, e)| *e == 0 || c == e)
}

fn kafka_config(bootstrap: &str) -> KafkaConfig {
    let mut k = KafkaConfig::new(bootstrap);
    k.session_timeout = Duration::from_secs(3);
    k.commit_interval = Duration::from_millis(200);
    k.drain_timeout = Duration::from_secs(10);
    k
}

#[test]
fn dead_letters_and_outbox_reach_their_topics_with_headers_and_poison_does_not_block() {
    let c = cluster();
    let (orders, payments, dlq) = (topic("orders"), topic("payments"), topic("dlq"));
    let mut config = Config::parse(&format!(
        r#"
[[subscriber]]
name = "orders"
key = {{ source = "header", name = "message-id" }}
handler = "{}"
max_attempts = 2
retry_backoff = "10ms"
# The attempts asserted below are the fixture's own: a first call slowed past the default
# budget on a loaded machine would be retried and counted.
handler_cpu_budget = "5s"

[[subscriber]]
name = "payments"
key = {{ source = "json_pointer", pointer = "/payment_id" }}
handler = "{}"
"#,
        component("fixture_errors").display(),
        component("payment_capture").display()
    ))
    .unwrap();
    let mut k = kafka_config(&c.bootstrap);
    k.dead_letter_topic = Some(dlq.clone());
    k.outbox.poll_interval = Duration::from_millis(20);
    k.subscriptions = vec![
        SubscriptionConfig {
            subscriber: "orders".into(),
            topics: vec![orders.clone()],
            group: Some(format!("g-{orders}")),
            changelog: false,
        },
        SubscriptionConfig {
            subscriber: "payments".into(),
            topics: vec![payments.clone()],
            group: Some(format!("g-{payments}")),
            changelog: false,
        },
    ];
    config.kafka = Some(k.clone());
    config.validate().unwrap();

    // One record key, so all land in one partition behind the poison messages.
    let id = |s: &str| vec![("message-id", s.to_string()), ("trace", "t-1".to_string())];
    produce(
        &c.bootstrap,
        &orders,
        &[
            Rec {
                key: "o-1",
                headers: id("m1"),
                payload: r#"{"n":1}"#.into(),
            },
            Rec {
                key: "o-1",
                headers: id("m2"),
                payload: r#"{"n":2,"permanent":true}"#.into(),
            },
            Rec {
                key: "o-1",
                headers: id("m3"),
                payload: r#"{"n":3,"retry":true}"#.into(),
            },
            Rec {
                key: "o-1",
                headers: vec![],
                payload: r#"{"n":4,"no":"key"}"#.into(),
            },
            Rec {
                key: "o-1",
                headers: id("m5"),
                payload: r#"{"n":5}"#.into(),
            },
        ],
    );
    let pay: Vec<Rec<'_>> = (0..3)
        .map(|i| Rec {
            key: "p",
            headers: vec![],
            payload: format!(r#"{{"payment_id":"p-{i}","amount_cents":100}}"#),
        })
        .collect();
    produce(&c.bootstrap, &payments, &pay);

    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    dedupd::pipeline::install_handlers(&ledger, &config).unwrap();
    let stop = Shutdown::new();
    let summary = std::thread::scope(|s| {
        let run = s.spawn(|| kafka::run(ledger.clone(), &k, &stop));
        let _guard = ShutdownOnDrop(&stop);
        wait_until("offsets at the log end", Duration::from_secs(60), || {
            at_log_end(&c.bootstrap, &format!("g-{orders}"), &orders)
                && at_log_end(&c.bootstrap, &format!("g-{payments}"), &payments)
        });
        let dead = read_all(&c.bootstrap, &dlq, 3);
        let relayed = read_all(&c.bootstrap, "payments.captured", 3);
        stop.trigger(Cause::Requested);
        let summary = run.join().unwrap().unwrap();
        (summary, dead, relayed)
    });
    let (summary, dead, relayed) = summary;
    assert_eq!(summary.processed, 2 + 3, "{summary:?}");
    assert_eq!(summary.dead_lettered, 2, "{summary:?}");
    assert_eq!(summary.rejected, 1, "{summary:?}");

    // Dead letters: the poison messages and the unkeyed one, with the documented headers.
    assert_eq!(dead.len(), 3);
    let by_offset: HashMap<String, &OwnedMessage> = dead
        .iter()
        .map(|m| (header(m, "dedupd-original-offset").unwrap(), m))
        .collect();
    let permanent = by_offset["1"];
    assert_eq!(
        header(permanent, "dedupd-subscriber").as_deref(),
        Some("orders")
    );
    assert_eq!(
        header(permanent, "dedupd-original-topic").as_deref(),
        Some(orders.as_str())
    );
    assert!(header(permanent, "dedupd-original-partition").is_some());
    assert_eq!(header(permanent, "dedupd-attempts").as_deref(), Some("1"));
    assert!(header(permanent, "dedupd-reason")
        .unwrap()
        .contains("permanent"));
    assert_eq!(
        header(permanent, "trace").as_deref(),
        Some("t-1"),
        "original headers kept"
    );
    assert_eq!(permanent.key(), Some(&b"o-1"[..]));
    assert_eq!(
        permanent.payload(),
        Some(&br#"{"n":2,"permanent":true}"#[..])
    );
    let retried = by_offset["2"];
    assert_eq!(header(retried, "dedupd-attempts").as_deref(), Some("2"));
    let unkeyed = by_offset["3"];
    assert_eq!(header(unkeyed, "dedupd-attempts").as_deref(), Some("0"));
    assert!(header(unkeyed, "dedupd-reason")
        .unwrap()
        .contains("message-id"));

    // Outbox rows: produced with their deterministic message id, then deleted.
    assert_eq!(relayed.len(), 3);
    for m in &relayed {
        assert!(header(m, "dedupd-message-id").is_some_and(|v| !v.is_empty()));
        assert!(header(m, "operation-key").is_some());
    }
    assert!(ledger.outbox_pending(10).unwrap().is_empty());
    // The ledger's dead letters name where each message came from: the handler's two
    // (an `Origin` formatted when the record is written) and the unkeyed one.
    let records = ledger
        .records(RecordKind::DeadLetter, "orders", None, 10)
        .unwrap();
    assert_eq!(records.len(), 3, "{records:?}");
    for r in &records {
        let origin = r.body["origin"].as_str().unwrap_or_default();
        let rest = origin
            .strip_prefix(&format!("kafka:{orders}/"))
            .unwrap_or_default();
        let parts: Vec<&str> = rest.split('/').collect();
        assert!(
            parts.len() == 2 && parts.iter().all(|p| p.parse::<i64>().is_ok()),
            "origin {origin:?}"
        );
    }
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    ledger.close().unwrap();
}

/// Subscriber `orders` keyed by the `message-id` header, consuming `topic` in group
/// `g-<topic>`.
fn header_keyed_config(bootstrap: &str, topic: &str) -> (Config, KafkaConfig) {
    let mut config = Config::parse(
        r#"
[[subscriber]]
name = "orders"
key = { source = "header", name = "message-id" }
"#,
    )
    .unwrap();
    let mut k = kafka_config(bootstrap);
    k.subscriptions = vec![SubscriptionConfig {
        subscriber: "orders".into(),
        topics: vec![topic.to_string()],
        group: Some(format!("g-{topic}")),
        changelog: false,
    }];
    config.kafka = Some(k.clone());
    config.validate().unwrap();
    (config, k)
}

/// Runs the Kafka source until group `g-<topic>` has committed the log end, then stops it.
fn consume_to_end(
    ledger: &Arc<Ledger>,
    k: &KafkaConfig,
    bootstrap: &str,
    topic: &str,
) -> kafka::KafkaSummary {
    let stop = Shutdown::new();
    std::thread::scope(|s| {
        let run = s.spawn(|| kafka::run(ledger.clone(), k, &stop));
        let _guard = ShutdownOnDrop(&stop);
        wait_until("offsets at the log end", Duration::from_secs(60), || {
            at_log_end(bootstrap, &format!("g-{topic}"), topic)
        });
        stop.trigger(Cause::Requested);
        run.join().unwrap().unwrap()
    })
}

/// A stop after the broker went away (as when the host it runs on goes down first) ends
/// within seconds, the source's work durable: every wait for the cluster at a stop (the
/// last offset commit, leaving the group) is bounded, as a process manager expects.
#[test]
fn a_stop_after_the_broker_went_away_ends_in_seconds() {
    logs();
    // A mock cluster of the test's own: its broker is taken down below.
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    let bootstrap = mock.bootstrap_servers();
    let t = topic("gone");
    mock.create_topic(&t, 2, 1).unwrap();
    let recs: Vec<Rec<'_>> = (0..50)
        .map(|n| Rec {
            key: ["a", "b"][n % 2],
            headers: vec![("message-id", format!("m-{n}"))],
            payload: format!(r#"{{"n":{n}}}"#),
        })
        .collect();
    produce(&bootstrap, &t, &recs);
    let (config, k) = header_keyed_config(&bootstrap, &t);
    let dir = tempfile::tempdir().unwrap();
    let running = start_source(&config, dir.path(), move |l, s| kafka::run(l, &k, s));
    wait_until("offsets at the log end", Duration::from_secs(60), || {
        at_log_end(&bootstrap, &format!("g-{t}"), &t)
    });
    mock.broker_down(1).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (summary, took) = running.stop_timed(Duration::from_secs(60));
    assert!(took < Duration::from_secs(15), "the stop took {took:?}");
    assert_eq!(summary.unwrap().processed, 50);
}

/// A record with no usable key is kept in the ledger as a dead letter; a binary payload
/// must be kept byte for byte (base64), not through a lossy UTF-8 conversion.
#[test]
fn unkeyed_binary_record_is_kept_byte_exact_in_the_ledger() {
    let c = cluster();
    let orders = topic("orders-binary");
    let (config, k) = header_keyed_config(&c.bootstrap, &orders);
    let payload: &[u8] = &[0xff, 0xfe, 0x00, b'a', 0x80];
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &c.bootstrap)
        .create()
        .unwrap();
    producer
        .send(BaseRecord::to(&orders).key("o-1").payload(payload))
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(30)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    let summary = consume_to_end(&ledger, &k, &c.bootstrap, &orders);
    assert_eq!(summary.rejected, 1, "{summary:?}");
    let records = ledger
        .records(RecordKind::DeadLetter, "orders", None, 10)
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let body = &records[0].body;
    assert_eq!(body["payload_base64"], "//4AYYA=", "{body}");
    assert!(body.get("payload").is_none(), "{body}");
    assert!(
        body["reason"].as_str().unwrap().contains("message-id"),
        "{body}"
    );
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    ledger.close().unwrap();
}

/// librdkafka is built with zstd: a zstd-compressed topic is consumed (it failed to
/// decompress before), every record processed once.
#[test]
fn zstd_compressed_records_are_consumed() {
    let c = cluster();
    let orders = topic("orders-zstd");
    let (config, k) = header_keyed_config(&c.bootstrap, &orders);
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &c.bootstrap)
        .set("compression.type", "zstd")
        .set("linger.ms", "20")
        .create()
        .unwrap();
    for i in 0..200 {
        let id = format!("m-{i}");
        let payload = format!(
            "{{\"order_id\":\"o-{i}\",\"note\":\"{}\"}}",
            "x".repeat(200)
        );
        let h = OwnedHeaders::new().insert(Header {
            key: "message-id",
            value: Some(id.as_bytes()),
        });
        producer
            .send(
                BaseRecord::to(&orders)
                    .key(&id)
                    .payload(&payload)
                    .headers(h),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    let summary = consume_to_end(&ledger, &k, &c.bootstrap, &orders);
    assert_eq!(summary.processed, 200, "{summary:?}");
    assert_eq!(summary.rejected, 0, "{summary:?}");
    // The only member holds every partition: no warning about a shared group.
    assert_eq!(summary.shared_group_rebalances, 0, "{summary:?}");
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    ledger.close().unwrap();
}

/// Kafka metrics carry the subscriber (two subscriptions' outcomes could not be told
/// apart before): every outcome counter and the lag gauge name it.
#[test]
fn kafka_metrics_name_the_subscriber() {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    let handle = HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .unwrap()
    });
    let c = cluster();
    let orders = topic("orders-metered");
    let (mut config, mut k) = header_keyed_config(&c.bootstrap, &orders);
    // A subscriber name no other test uses, so its series are this test's alone.
    config.subscribers[0].name = "kafka-metered".into();
    k.subscriptions[0].subscriber = "kafka-metered".into();
    config.kafka = Some(k.clone());
    let mut recs: Vec<Rec<'_>> = (0..30)
        .map(|i| Rec {
            key: "o-1",
            headers: vec![("message-id", format!("m-{}", i % 20))],
            payload: format!(r#"{{"n":{}}}"#, i % 20),
        })
        .collect();
    recs.push(Rec {
        key: "o-1",
        headers: vec![],
        payload: "{}".into(),
    });
    produce(&c.bootstrap, &orders, &recs);
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    let summary = consume_to_end(&ledger, &k, &c.bootstrap, &orders);
    assert_eq!(
        (summary.processed, summary.duplicate, summary.rejected),
        (20, 10, 1),
        "{summary:?}"
    );
    let text = handle.render();
    let value = |outcome: &str| -> Option<f64> {
        text.lines()
            .find(|l| {
                l.starts_with("dedupd_kafka_messages_total{")
                    && l.contains("subscriber=\"kafka-metered\"")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    assert_eq!(value("processed"), Some(20.0), "{text}");
    assert_eq!(value("duplicate"), Some(10.0), "{text}");
    assert_eq!(value("rejected"), Some(1.0), "{text}");
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    ledger.close().unwrap();
}

#[test]
fn rebalance_moves_partitions_without_double_processing() {
    let c = cluster();
    let t = topic("rebalance");
    let group = format!("g-{t}");
    let config = Config::parse(
        "[[subscriber]]\nname = \"s\"\nkey = { source = \"header\", name = \"message-id\" }\n",
    )
    .unwrap();
    let k = kafka_config(&c.bootstrap);
    let sub = SubscriptionConfig {
        subscriber: "s".into(),
        topics: vec![t.clone()],
        group: Some(group.clone()),
        changelog: false,
    };
    const N: usize = 6000;
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let ledgers: Vec<Arc<Ledger>> = dirs
        .iter()
        .map(|d| Arc::new(Ledger::open(d.path(), &config, Arc::new(SystemClock)).unwrap()))
        .collect();
    let stats = [
        Arc::new(SourceStats::default()),
        Arc::new(SourceStats::default()),
    ];
    let stops = [AtomicBool::new(false), AtomicBool::new(false)];
    std::thread::scope(|s| {
        // Production goes on while the group rebalances, so the revoked member has work
        // in flight.
        let producer = s.spawn(|| {
            // ~10 s of traffic: longer than a rebalance takes on the mock cluster.
            for chunk in 0..40 {
                let recs: Vec<Rec<'_>> = (0..N / 40)
                    .map(|i| {
                        let n = chunk * (N / 40) + i;
                        Rec {
                            key: ["a", "b", "c", "d"][n % 4],
                            headers: vec![("message-id", format!("m-{n}"))],
                            payload: format!(r#"{{"n":{n}}}"#),
                        }
                    })
                    .collect();
                produce(&c.bootstrap, &t, &recs);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let run = |i: usize| {
            let (ledger, k, sub, stop, st) =
                (ledgers[i].clone(), &k, &sub, &stops[i], stats[i].clone());
            move || kafka::run_subscription(ledger, k, sub, stop, st, &RunOptions::default())
        };
        let a = s.spawn(run(0));
        let _guards = (StopOnDrop(&stops[0]), StopOnDrop(&stops[1]));
        wait_until(
            "the first member to process",
            Duration::from_secs(30),
            || stats[0].released.load(Ordering::Relaxed) > 300,
        );
        let b = s.spawn(run(1));
        wait_until(
            "the second member to get partitions",
            Duration::from_secs(30),
            || stats[1].released.load(Ordering::Relaxed) > 0,
        );
        producer.join().unwrap();
        wait_until("offsets at the log end", Duration::from_secs(60), || {
            let ends = committed_and_end(&c.bootstrap, &group, &t);
            ends.iter().map(|(_, e)| e).sum::<i64>() == N as i64
                && at_log_end(&c.bootstrap, &group, &t)
        });
        stops[0].store(true, Ordering::Relaxed);
        stops[1].store(true, Ordering::Relaxed);
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    });
    let processed: Vec<u64> = stats
        .iter()
        .map(|s| s.processed.load(Ordering::Relaxed))
        .collect();
    let duplicates: u64 = stats
        .iter()
        .map(|s| s.duplicate.load(Ordering::Relaxed))
        .sum();
    let claims: Vec<u64> = ledgers
        .iter()
        .map(|l| {
            l.report()
                .unwrap()
                .subscribers
                .iter()
                .map(|s| s.claims)
                .sum()
        })
        .collect();
    // Two separate ledgers: a message processed by both would be claimed twice. That
    // happens exactly when the coordinator refuses the commit made before the revoked
    // partitions move (a rebalance in progress; the mock cluster does it in about one run
    // in five on a busy machine): the new owner starts from the last committed offset and
    // the instances share no claims (docs/kafka.md, "Without a changelog: one instance per
    // consumer group";
    // issue 17). The member counts and logs that; without it, nothing is doubled.
    let refused: u64 = stats
        .iter()
        .map(|s| s.revoke_commit_failures.load(Ordering::Relaxed))
        .sum();
    if refused == 0 {
        assert_eq!(claims[0] + claims[1], N as u64, "claims {claims:?}");
        assert_eq!(
            processed[0] + processed[1],
            N as u64,
            "processed {processed:?}"
        );
    } else {
        eprintln!(
            "{refused} commit(s) before a revoke refused: {} messages processed by both members",
            claims[0] + claims[1] - N as u64
        );
        assert!(
            claims[0] + claims[1] >= N as u64,
            "claims {claims:?}: one lost"
        );
        assert_eq!(
            processed[0] + processed[1],
            claims[0] + claims[1],
            "processed {processed:?}"
        );
    }
    assert_eq!(
        duplicates, 0,
        "no message was delivered again to the same member"
    );
    assert!(processed[1] > 0, "a partition moved to the second member");
    assert!(stats[0].revoked_partitions.load(Ordering::Relaxed) > 0);
    assert_eq!(stats[0].revoke_drain_timeouts.load(Ordering::Relaxed), 0);
    // Two members in one group do not share claims: both are told so.
    for (i, st) in stats.iter().enumerate() {
        assert!(
            st.shared_group_rebalances.load(Ordering::Relaxed) > 0,
            "member {i} did not warn that the group is shared"
        );
    }
}

/// Kills a child process when dropped, so a failed test leaves no engine running.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Log lines without terminal colour codes.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn write_config(
    dir: &Path,
    bootstrap: &str,
    topic: &str,
    group: &str,
    commit_interval: &str,
) -> PathBuf {
    let path = dir.join("dedupd.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[[subscriber]]
name = "orders"
key = {{ source = "header", name = "message-id" }}

[kafka]
brokers = "{bootstrap}"
group = "{group}"
session_timeout = "3s"
commit_interval = "{commit_interval}"

[[kafka.subscription]]
subscriber = "orders"
topics = ["{topic}"]
"#
        ),
    )
    .unwrap();
    path
}

#[test]
fn crash_after_commit_before_offsets_redelivers_as_duplicates() {
    let c = cluster();
    let t = topic("crash");
    let group = format!("g-{t}");
    const N: usize = 20_000;
    let recs: Vec<Rec<'_>> = (0..N)
        .map(|n| Rec {
            key: ["a", "b", "c", "d"][n % 4],
            headers: vec![("message-id", format!("m-{n}"))],
            payload: format!(r#"{{"n":{n}}}"#),
        })
        .collect();
    produce(&c.bootstrap, &t, &recs);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let bin = env!("CARGO_BIN_EXE_dedupd");

    // Run 1: offsets are never committed (1h interval); killed once some outcomes are durable.
    let cfg = write_config(dir.path(), &c.bootstrap, &t, &group, "1h");
    let mut child = KillOnDrop(
        Command::new(bin)
            .args(["run", "--config"])
            .arg(&cfg)
            .arg("--data-dir")
            .arg(&data)
            .env("RUST_LOG", "dedupd=info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = BufReader::new(child.0.stderr.take().unwrap());
    let mut released_before_kill = 0u64;
    for line in stderr.lines() {
        let line = strip_ansi(&line.unwrap());
        if let Some(v) = line.split("released=").nth(1) {
            let n: u64 = v.split_whitespace().next().unwrap().parse().unwrap();
            if n > 0 {
                released_before_kill = n;
                break;
            }
        }
    }
    drop(child); // SIGKILL
    assert!(released_before_kill > 0);
    assert!(
        committed_and_end(&c.bootstrap, &group, &t)
            .iter()
            .all(|(c, _)| *c < 0),
        "run 1 committed no offsets"
    );

    // Run 2: everything is delivered again; what run 1 claimed is a duplicate now.
    let cfg = write_config(dir.path(), &c.bootstrap, &t, &group, "200ms");
    let mut child = KillOnDrop(
        Command::new(bin)
            .args(["run", "--config"])
            .arg(&cfg)
            .arg("--data-dir")
            .arg(&data)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut stdout = child.0.stdout.take().unwrap();
    wait_until("offsets at the log end", Duration::from_secs(90), || {
        at_log_end(&c.bootstrap, &group, &t)
    });
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut printed = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut printed).unwrap();
    let exit = child.0.wait().unwrap();
    let out = std::process::Output {
        status: exit,
        stdout: printed,
        stderr: Vec::new(),
    };
    assert!(
        out.status.success(),
        "graceful stop exits 0: {:?}",
        out.status
    );
    let summary: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii()).unwrap();
    let k = &summary["kafka"];
    let (processed, duplicate) = (
        k["processed"].as_u64().unwrap(),
        k["duplicate"].as_u64().unwrap(),
    );
    assert_eq!(processed + duplicate, N as u64, "{summary}");
    assert!(
        duplicate >= released_before_kill,
        "{summary}: run 1 released {released_before_kill}"
    );
    assert!(
        at_log_end(&c.bootstrap, &group, &t),
        "offsets end at the log end"
    );

    // Every message claimed exactly once across both runs.
    let config = Config::load(&cfg).unwrap();
    let ledger = Ledger::open(&data, &config, Arc::new(SystemClock)).unwrap();
    let claims: u64 = ledger
        .report()
        .unwrap()
        .subscribers
        .iter()
        .map(|s| s.claims)
        .sum();
    assert_eq!(claims, N as u64);
    ledger.close().unwrap();
}

#[test]
fn dev_broker_prints_a_bootstrap_address_and_stops_on_sigterm() {
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["dev-broker", "--topic", "t1:2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().to_string();
    assert!(addr.contains(':'), "{addr:?}");
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &addr)
        .create()
        .unwrap();
    let md = c
        .fetch_metadata(Some("t1"), Duration::from_secs(10))
        .unwrap();
    assert_eq!(md.topics()[0].partitions().len(), 2);
    Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(child.0.wait().unwrap().success());
}

fn mix_u64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

/// `dedupd run` on Kafka with the non-idempotent `fixture-counter` handler (`count/<order>`
/// = get + 1), a 64-entry state buffer and offsets committed every 100 ms, killed with
/// kill -9 ten times at seeded moments (so kills land just after offset commits, during
/// state flushes and merges, and while the group is rebalancing after the previous
/// restart), then run to the log end. The topic holds two distinct events per order and
/// redeliveries of earlier records. Afterwards every order's count is exactly 2: an effect
/// applied twice, or an offset committed past a message whose effect was not durable (it
/// would never be delivered again), would change a count.
#[test]
fn counts_are_exact_after_ten_kill_9_rounds_on_kafka() {
    let c = cluster();
    let t = topic("kill-loop");
    let group = format!("g-{t}");
    const EVENTS: usize = 40_000;
    let mut recs: Vec<Rec<'_>> = Vec::new();
    for n in 0..EVENTS {
        let rec = |n: usize| Rec {
            key: ["a", "b", "c", "d"][(n / 2) % 4],
            headers: vec![("message-id", format!("e-{n}"))],
            payload: format!(
                r#"{{"type":"OrderPlaced","order_id":"o-{}","n":{n}}}"#,
                n / 2
            ),
        };
        recs.push(rec(n));
        if n % 10 == 9 {
            recs.push(rec(n - 7)); // a redelivery of an earlier record
        }
    }
    // Produced in 11 parts, one before each run, so every kill lands mid-stream however
    // fast the engine is: ten killed runs, then one that finishes.
    let parts: Vec<&[Rec<'_>]> = recs.chunks(recs.len().div_ceil(11)).collect();
    assert_eq!(parts.len(), 11);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("dedupd.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[ledger]
state_buffer_entries = 64

[[subscriber]]
name = "orders"
key = {{ source = "header", name = "message-id" }}
partition_key = {{ source = "json_pointer", pointer = "/order_id" }}
handler = {:?}
handler_cpu_budget = "2s"

[kafka]
brokers = "{}"
group = "{group}"
session_timeout = "3s"
commit_interval = "100ms"

[[kafka.subscription]]
subscriber = "orders"
topics = ["{t}"]
"#,
            component("fixture_counter").display().to_string(),
            c.bootstrap
        ),
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_dedupd");
    let log = dir.path().join("run.log");
    let start = || {
        KillOnDrop(
            Command::new(bin)
                .args(["run", "--config"])
                .arg(&cfg)
                .arg("--data-dir")
                .arg(&data)
                .env("NO_COLOR", "1")
                .env("RUST_LOG", "dedupd=info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let committed = || -> i64 {
        committed_and_end(&c.bootstrap, &group, &t)
            .iter()
            .map(|(c, _)| (*c).max(0))
            .sum()
    };
    let mut committed_at_kills = Vec::new();
    let mut produced = 0;
    for (round, part) in parts[..10].iter().enumerate() {
        produce(&c.bootstrap, &t, part);
        produced += part.len();
        let before = committed();
        let child = start();
        // Each round waits for the group to settle after the last kill (the dead member
        // holds its partitions until its session times out). Even rounds then kill 0-300 ms
        // after the partitions are assigned (mid-batch, mid-flush, before any commit); odd
        // rounds 0-150 ms after an offset commit past the last round's (just after a
        // commit, or while the next one is being made).
        wait_until("partitions assigned", Duration::from_secs(60), || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("kafka partition assigned"))
        });
        let r = mix_u64((round as u64) ^ common::seed(0x5eed));
        if round % 2 == 1 {
            wait_until("an offset commit", Duration::from_secs(60), || {
                committed() > before
            });
            std::thread::sleep(Duration::from_millis(r % 150));
        } else {
            std::thread::sleep(Duration::from_millis(r % 300));
        }
        drop(child); // SIGKILL
        committed_at_kills.push((committed(), produced));
    }
    produce(&c.bootstrap, &t, parts[10]);
    let mut child = start();
    // Stopped only once it holds its partitions (a SIGTERM before the engine installs its
    // handler ends it by the signal) and the group's offsets are at the log end.
    wait_until("partitions assigned", Duration::from_secs(60), || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("kafka partition assigned"))
    });
    wait_until("offsets at the log end", Duration::from_secs(180), || {
        at_log_end(&c.bootstrap, &group, &t)
    });
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.0.wait().unwrap();
    assert!(
        exit.success(),
        "graceful stop exits 0, got {exit:?}: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    eprintln!("(offsets committed, records produced) at the kills: {committed_at_kills:?}");

    assert_counts_exact(&data, &Config::load(&cfg).unwrap(), EVENTS);
}

/// Opens a stopped engine's data directory and asserts one claim per distinct event of
/// `events` and every `fixture-counter` order (two events each) counted exactly 2.
fn assert_counts_exact(data: &Path, config: &Config, events: usize) {
    let ledger = Ledger::open(data, config, Arc::new(SystemClock)).unwrap();
    let counts: Vec<(Vec<u8>, Vec<u8>)> = ledger.state_entries("orders").unwrap();
    let claims: u64 = ledger
        .report()
        .unwrap()
        .subscribers
        .iter()
        .map(|s| s.claims)
        .sum();
    ledger.close().unwrap();
    assert_eq!(claims, events as u64, "one claim per distinct event");
    assert_eq!(counts.len(), events / 2, "orders lost or split");
    let wrong: Vec<_> = counts
        .iter()
        .filter(|(_, v)| v.as_slice() != b"2")
        .take(5)
        .map(|(k, v)| {
            (
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect();
    assert!(wrong.is_empty(), "counts doubled or lost: {wrong:?}");
}

/// [`wait_until`], showing a child's log if the wait times out.
fn wait_showing(what: &str, timeout: Duration, log: &Path, f: impl FnMut() -> bool) {
    let shown = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(what, timeout, f)
    }));
    if let Err(e) = shown {
        eprintln!(
            "--- {} ---\n{}",
            log.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
}

/// The `run` summary a child printed on stdout after SIGTERM.
fn stop_and_summary(mut child: KillOnDrop, log: &Path) -> serde_json::Value {
    let mut stdout = child.0.stdout.take().unwrap();
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut printed = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut printed).unwrap();
    let exit = child.0.wait().unwrap();
    assert!(
        exit.success(),
        "graceful stop exits 0, got {exit:?}: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    serde_json::from_slice(printed.trim_ascii()).unwrap()
}

/// `fixture-counter` events `n` of `range`: two per order (`o-<n/2>`), six record keys;
/// with `redeliver`, every tenth is followed by a redelivery of an earlier one.
fn counter_records(range: std::ops::Range<usize>, redeliver: bool) -> Vec<Rec<'static>> {
    let rec = |n: usize| Rec {
        key: ["a", "b", "c", "d", "e", "f"][(n / 2) % 6],
        headers: vec![("message-id", format!("e-{n}"))],
        payload: format!(
            r#"{{"type":"OrderPlaced","order_id":"o-{}","n":{n}}}"#,
            n / 2
        ),
    };
    let mut recs = Vec::new();
    for n in range {
        recs.push(rec(n));
        if redeliver && n % 10 == 9 {
            recs.push(rec(n - 7)); // a redelivery of an earlier record
        }
    }
    recs
}

/// `dedupd run` instances of one consumer group on one topic, with `changelog = true` and
/// the non-idempotent `fixture-counter` handler, each in a data directory of its own.
struct Members {
    dir: tempfile::TempDir,
    bootstrap: String,
    topic: String,
    group: String,
    changelog: String,
}

/// How often a line occurs in a log.
fn log_has(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log).map_or(0, |l| l.matches(what).count())
}

/// Whether a `kafka progress` line of the log says at least `n` messages were released.
fn released_at_least(log: &Path, n: u64) -> bool {
    std::fs::read_to_string(log).is_ok_and(|l| {
        l.lines()
            .filter_map(|l| l.split("released=").nth(1))
            .any(|v| {
                v.split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .is_some_and(|v| v >= n)
            })
    })
}

const RESTORED: &str = "partitions restored from the changelog";

/// Where a member's log says it moved each partition's checkpoint last (the debug lines
/// `changelog checkpoints moved ... moved=[(0, 3071), (2, 2990)]`).
fn checkpoints_moved(log: &Path) -> HashMap<i32, i64> {
    let mut out = HashMap::new();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    for line in text
        .lines()
        .filter(|l| l.contains("changelog checkpoints moved"))
    {
        let Some(list) = line
            .split("moved=[")
            .nth(1)
            .and_then(|r| r.split(']').next())
        else {
            continue;
        };
        for pair in list.split("), (") {
            let pair = pair.trim_matches(|c| c == '(' || c == ')');
            let mut it = pair.split(", ");
            if let (Some(p), Some(o)) = (it.next(), it.next()) {
                if let (Ok(p), Ok(o)) = (p.parse::<i32>(), o.parse::<i64>()) {
                    out.insert(p, o);
                }
            }
        }
    }
    out
}

impl Members {
    fn new(c: &Cluster, topic: &str) -> Members {
        let changelog = format!("{topic}-orders-changelog");
        if let Some(mock) = &c._mock {
            // The mock cluster has no CreateTopics; a real one gets it from dedupd.
            mock.create_topic(&changelog, 4).unwrap();
        }
        Members {
            dir: tempfile::tempdir().unwrap(),
            bootstrap: c.bootstrap.clone(),
            topic: topic.to_string(),
            group: format!("g-{topic}"),
            changelog,
        }
    }

    /// The config of member `name`, changelog checkpoints moved every 10 s while it runs.
    fn config(&self, name: &str, commit_interval: &str) -> PathBuf {
        self.config_with(name, commit_interval, "10s")
    }

    fn config_with(&self, name: &str, commit_interval: &str, checkpoints: &str) -> PathBuf {
        self.write_config(
            name,
            &format!(
                "partition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\nhandler = {:?}\nhandler_cpu_budget = \"2s\"",
                component("fixture_counter").display().to_string()
            ),
            &format!("commit_interval = \"{commit_interval}\""),
            &format!("checkpoint_interval = \"{checkpoints}\""),
        )
    }

    /// Writes member `name`'s config: subscriber `orders` keyed by its `message-id` header
    /// in this group with a changelog, plus the given lines of the subscriber, of `[kafka]`
    /// (which may end with its own sub-tables) and of `[kafka.changelog]`.
    fn write_config(&self, name: &str, subscriber: &str, kafka: &str, changelog: &str) -> PathBuf {
        let cfg = self.dir.path().join(format!("{name}.toml"));
        let (bootstrap, group, topic) = (&self.bootstrap, &self.group, &self.topic);
        std::fs::write(
            &cfg,
            format!(
                r#"
[[subscriber]]
name = "orders"
key = {{ source = "header", name = "message-id" }}
{subscriber}

[kafka]
brokers = "{bootstrap}"
group = "{group}"
session_timeout = "3s"
{kafka}

[kafka.changelog]
prefix = "{topic}"
replication_factor = 1
{changelog}

[[kafka.subscription]]
subscriber = "orders"
topics = ["{topic}"]
changelog = true
"#
            ),
        )
        .unwrap();
        cfg
    }

    /// Starts member `name` on its data directory; its log is `<name>.log` (truncated).
    fn start(&self, name: &str, commit_interval: &str) -> (KillOnDrop, PathBuf) {
        self.start_with(name, commit_interval, "10s")
    }

    fn start_with(
        &self,
        name: &str,
        commit_interval: &str,
        checkpoints: &str,
    ) -> (KillOnDrop, PathBuf) {
        let cfg = self.config_with(name, commit_interval, checkpoints);
        self.spawn(name, &cfg)
    }

    /// Starts member `name` with the config file `cfg`.
    fn spawn(&self, name: &str, cfg: &Path) -> (KillOnDrop, PathBuf) {
        let log = self.dir.path().join(format!("{name}.log"));
        let child = KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_dedupd"))
                .args(["run", "--config"])
                .arg(cfg)
                .arg("--data-dir")
                .arg(self.dir.path().join(name))
                .env("NO_COLOR", "1")
                .env(
                    "RUST_LOG",
                    "dedupd=info,dedupd::source::kafka::consumer=debug",
                )
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        );
        (child, log)
    }

    /// Records in the changelog, of every kind but fences (the mock broker compacts
    /// nothing; a member fences each partition it is assigned).
    fn published(&self) -> i64 {
        read_to_end(&self.bootstrap, &self.changelog)
            .iter()
            .filter(|m| !is_fence(m))
            .count() as i64
    }

    /// The changelog's records by kind.
    fn kinds(&self) -> Kinds {
        Kinds::of(&read_to_end(&self.bootstrap, &self.changelog))
    }

    /// Claims and counts of member `name`'s data directory (stopped); asserts every order
    /// of `events` distinct events counts exactly 2 and one claim per event.
    fn assert_exact(&self, name: &str, events: usize) {
        let config = Config::load(&self.config(name, "1s")).unwrap();
        assert_counts_exact(&self.dir.path().join(name), &config, events);
    }
}

/// Issue 17: what a handler emitted leaves before its partition does. With a changelog
/// the new owner of a partition restores its claims and never runs the handler again, so
/// a row left in the old owner's outbox would be relayed only if that member came back.
/// Member A (its relay polls every 60 s, so emitted rows wait in the outbox) processes
/// every payment; B joins and A hands it partitions, relaying its pending rows first; then
/// A is killed with kill -9 and its data directory deleted. Every payment's
/// `payments.captured` message is on the topic, with its `dedupd-message-id`.
#[test]
fn outbox_rows_leave_before_their_partitions_move() {
    let c = cluster();
    let t = topic("outbox-moves");
    let g = Members::new(&c, &t);
    const PAYMENTS: usize = 600;
    let recs: Vec<Rec<'_>> = (0..PAYMENTS)
        .map(|i| Rec {
            key: ["a", "b", "c", "d", "e", "f"][i % 6],
            headers: vec![("message-id", format!("p-{i}"))],
            payload: format!(r#"{{"payment_id":"p-{i}","amount_cents":100}}"#),
        })
        .collect();
    produce(&c.bootstrap, &t, &recs);
    let config = |name: &str| -> PathBuf {
        g.write_config(
            name,
            &format!(
                "handler = {:?}",
                component("payment_capture").display().to_string()
            ),
            "commit_interval = \"100ms\"\n\n[kafka.outbox]\npoll_interval = \"60s\"",
            "",
        )
    };
    let (a, a_log) = g.spawn("a", &config("a"));
    wait_showing("A to process", Duration::from_secs(90), &a_log, || {
        released_at_least(&a_log, PAYMENTS as u64)
    });
    let (_b, b_log) = g.spawn("b", &config("b"));
    wait_showing(
        "B to get partitions",
        Duration::from_secs(60),
        &b_log,
        || log_has(&b_log, RESTORED) > 0,
    );
    drop(a); // SIGKILL
    std::fs::remove_dir_all(g.dir.path().join("a")).unwrap();
    let relayed = read_all(&c.bootstrap, "payments.captured", PAYMENTS);
    let ids: std::collections::BTreeSet<String> = relayed
        .iter()
        .map(|m| header(m, "dedupd-message-id").expect("every relayed row has its id"))
        .collect();
    let payments: std::collections::BTreeSet<String> = relayed
        .iter()
        .filter_map(|m| m.key().map(|k| String::from_utf8_lossy(k).into_owned()))
        .collect();
    assert_eq!(
        payments.len(),
        PAYMENTS,
        "every payment's message left before A died ({} relayed); A's log:\n{}",
        relayed.len(),
        std::fs::read_to_string(&a_log).unwrap_or_default()
    );
    assert_eq!(ids.len(), PAYMENTS, "one message id per payment");
    assert!(
        log_has(
            &a_log,
            "outbox rows relayed before the revoked partitions were released"
        ) > 0
    );
}

/// Issue 17: what a handler emitted survives the crash of its member and the loss of its
/// disk. Member A relays the messages of the first 300 payments (so their emitted records
/// in the changelog get the relay's tombstones) and stops; started again with a relay
/// that polls every 60 s, it processes 300 more and is killed with kill -9 before relaying
/// them, and its data directory is deleted. B, with an empty data directory, restores the
/// partitions and relays exactly the 300 never relayed: every payment's message is on the
/// topic once, with its `dedupd-message-id`, and B processes nothing again.
#[test]
fn emitted_messages_outlive_a_crashed_member_and_its_disk() {
    let c = cluster();
    let t = topic("outbox-crash");
    let g = Members::new(&c, &t);
    const HALF: usize = 300;
    let recs: Vec<Rec<'_>> = (0..2 * HALF)
        .map(|i| Rec {
            key: ["a", "b", "c", "d", "e", "f"][i % 6],
            headers: vec![("message-id", format!("p-{i}"))],
            payload: format!(r#"{{"payment_id":"p-{i}","amount_cents":100}}"#),
        })
        .collect();
    let config = |name: &str, poll: &str| -> PathBuf {
        g.write_config(
            name,
            &format!(
                "handler = {:?}",
                component("payment_capture").display().to_string()
            ),
            &format!("commit_interval = \"100ms\"\n\n[kafka.outbox]\npoll_interval = \"{poll}\""),
            "",
        )
    };
    produce(&c.bootstrap, &t, &recs[..HALF]);
    let (a, a_log) = g.spawn("a", &config("a", "100ms"));
    wait_showing("A to process", Duration::from_secs(90), &a_log, || {
        released_at_least(&a_log, HALF as u64)
    });
    let first = stop_and_summary(a, &a_log);
    assert_eq!(first["kafka"]["outbox_relayed"], HALF, "{first}");

    let (a, a_log) = g.spawn("a", &config("a", "60s"));
    produce(&c.bootstrap, &t, &recs[HALF..]);
    wait_showing(
        "A to process again",
        Duration::from_secs(90),
        &a_log,
        || released_at_least(&a_log, HALF as u64),
    );
    drop(a); // SIGKILL, with the second half's messages still in its outbox
    std::fs::remove_dir_all(g.dir.path().join("a")).unwrap();
    let on_topic = || -> i64 {
        committed_and_end(&c.bootstrap, "nobody", "payments.captured")
            .iter()
            .map(|(_, end)| end)
            .sum()
    };
    assert_eq!(on_topic(), HALF as i64, "A relayed the first half only");

    let (b, b_log) = g.spawn("b", &config("b", "100ms"));
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, RESTORED) > 0
    });
    wait_showing("B to relay", Duration::from_secs(60), &b_log, || {
        on_topic() >= 2 * HALF as i64
    });
    let summary = stop_and_summary(b, &b_log);
    let relayed = read_to_end(&c.bootstrap, "payments.captured");
    let payments: std::collections::BTreeSet<String> = relayed
        .iter()
        .filter_map(|m| m.key().map(|k| String::from_utf8_lossy(k).into_owned()))
        .collect();
    let ids: std::collections::BTreeSet<String> = relayed
        .iter()
        .map(|m| header(m, "dedupd-message-id").expect("every relayed row has its id"))
        .collect();
    assert_eq!(
        payments.len(),
        2 * HALF,
        "every payment's message is relayed ({} on the topic); B's log:\n{}",
        relayed.len(),
        std::fs::read_to_string(&b_log).unwrap_or_default()
    );
    assert_eq!(ids.len(), 2 * HALF, "one message id per payment");
    assert_eq!(on_topic(), 2 * HALF as i64, "none relayed twice: {summary}");
    assert_eq!(summary["kafka"]["restored_emitted"], HALF, "{summary}");
    assert_eq!(summary["kafka"]["outbox_relayed"], HALF, "{summary}");
    assert_eq!(summary["kafka"]["processed"], 0, "{summary}");
}

/// Issue 17: quarantine and dead-letter records follow their partitions too. Member A
/// quarantines payloads that reuse a payment's id (one of them twice: one record, count 2)
/// and dead-letters payloads the handler refuses for good; there is no dead-letter topic,
/// so A's ledger is all that keeps them. A stops and its data directory is lost. B, with
/// an empty one, restores the partitions and holds every record A held, bodies and counts
/// included, without seeing any of those messages again.
#[test]
fn quarantine_and_dead_letter_records_outlive_a_member_and_its_disk() {
    let c = cluster();
    let t = topic("records-move");
    let g = Members::new(&c, &t);
    const N: usize = 60;
    let keys = ["a", "b", "c", "d", "e", "f"];
    let rec = |i: usize, id: String, payload: String| Rec {
        key: keys[i % 6],
        headers: vec![("message-id", id)],
        payload,
    };
    let mut recs: Vec<Rec<'_>> = (0..N)
        .map(|i| {
            let payload = format!(r#"{{"payment_id":"p-{i}","amount_cents":100}}"#);
            rec(i, format!("p-{i}"), payload)
        })
        .collect();
    // After their originals in the same partitions (same record keys): quarantined.
    for i in [0, 1, 2, 3, 4, 5, 6, 7, 0] {
        let payload = format!(r#"{{"payment_id":"p-{i}","amount_cents":999}}"#);
        recs.push(rec(i, format!("p-{i}"), payload));
    }
    for i in 0..5 {
        recs.push(rec(i, format!("bad-{i}"), "not json".into()));
    }
    let config = |name: &str| -> PathBuf {
        g.write_config(
            name,
            &format!(
                "handler = {:?}",
                component("payment_capture").display().to_string()
            ),
            "commit_interval = \"100ms\"\n\n[kafka.outbox]\npoll_interval = \"100ms\"",
            "",
        )
    };
    produce(&c.bootstrap, &t, &recs);
    let (a, a_log) = g.spawn("a", &config("a"));
    wait_showing("A to process", Duration::from_secs(90), &a_log, || {
        released_at_least(&a_log, recs.len() as u64)
    });
    let first = stop_and_summary(a, &a_log);
    assert_eq!(
        (
            first["kafka"]["quarantined"].as_u64(),
            first["kafka"]["dead_lettered"].as_u64()
        ),
        (Some(9), Some(5)),
        "{first}"
    );
    std::fs::remove_dir_all(g.dir.path().join("a")).unwrap();

    let cfg_b = config("b");
    let (b, b_log) = g.spawn("b", &cfg_b);
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, RESTORED) > 0
    });
    let summary = stop_and_summary(b, &b_log);
    assert_eq!(summary["kafka"]["restored_records"], 8 + 5, "{summary}");
    for k in ["processed", "quarantined", "dead_lettered"] {
        assert_eq!(summary["kafka"][k], 0, "{k}: {summary}");
    }

    let ledger = Ledger::open(
        &g.dir.path().join("b"),
        &Config::load(&cfg_b).unwrap(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let ids_and_counts = |kind| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = ledger
            .records(kind, "orders", None, 100)
            .unwrap()
            .into_iter()
            .map(|r| {
                (
                    r.body["id"].as_str().unwrap().to_string(),
                    r.body["count"].as_u64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let want: Vec<(String, u64)> = (0..8)
        .map(|i| (format!("p-{i}"), if i == 0 { 2 } else { 1 }))
        .collect();
    assert_eq!(ids_and_counts(RecordKind::Quarantine), want);
    let want: Vec<(String, u64)> = (0..5).map(|i| (format!("bad-{i}"), 1)).collect();
    assert_eq!(ids_and_counts(RecordKind::DeadLetter), want);
    let quarantined = ledger
        .records(RecordKind::Quarantine, "orders", None, 100)
        .unwrap();
    assert!(
        quarantined.iter().all(|r| r.body["payload"]
            .as_str()
            .is_some_and(|p| p.contains("999"))),
        "the quarantined payloads are kept: {quarantined:?}"
    );
    ledger.close().unwrap();
}

/// Issue 17: with `changelog = true`, claims and handler state follow their partitions.
/// Instance A (the non-idempotent `fixture-counter` handler, offsets never committed)
/// processes part of the stream and is killed with kill -9: every message is delivered
/// again to the next owners. Instances B and C, with empty data directories, join the
/// group and restore their partitions from A's changelog; the rest of the stream arrives
/// while they run, C is killed with kill -9 mid-stream and a fourth instance D joins;
/// then D stops and B takes its partitions back, restoring them over what it held before.
/// The changelog holds exactly one change per distinct event (no event processed twice
/// by the four instances), and B alone ends with one claim per event and every order's
/// count exactly 2. Then B restarts on its own data directory: gracefully stopped it
/// restores nothing, killed it restores only the changes since its checkpoint.
#[test]
fn claims_and_state_follow_their_partitions_through_a_changelog() {
    let c = cluster();
    let t = topic("changelog");
    let g = Members::new(&c, &t);
    let group = g.group.clone();
    const EVENTS: usize = 12_000;
    let recs = counter_records(0..EVENTS, true);
    let (first, second) = recs.split_at(recs.len() / 2);
    produce(&c.bootstrap, &t, first);
    let changelog = g.changelog.clone();
    let dir = &g.dir;
    let write_cfg = |name: &str, commit_interval: &str| g.config(name, commit_interval);
    let start = |name: &str, commit_interval: &str| g.start(name, commit_interval);

    // A: offsets never committed (1h); killed once it released a few thousand messages.
    let (a, a_log) = start("a", "1h");
    wait_showing("A to process", Duration::from_secs(90), &a_log, || {
        released_at_least(&a_log, 2000)
    });
    drop(a); // SIGKILL
    assert!(
        committed_and_end(&c.bootstrap, &group, &t)
            .iter()
            .all(|(c, _)| *c < 0),
        "A committed no offsets"
    );
    let cfg_a = write_cfg("a", "1h");
    let config = Config::load(&cfg_a).unwrap();
    let claims_of = |data: &Path| -> u64 {
        let ledger = Ledger::open(data, &config, Arc::new(SystemClock)).unwrap();
        let claims = ledger
            .report()
            .unwrap()
            .subscribers
            .iter()
            .map(|s| s.claims)
            .sum();
        ledger.close().unwrap();
        claims
    };
    // Released messages include the stream's redeliveries (one record in eleven), which
    // store no claim: 2,000 released can be ~1,820 claims (1,863 in one run).
    let by_a = claims_of(&dir.path().join("a"));
    assert!(by_a >= 1700, "A committed {by_a} claims");

    // B and C: empty data directories; everything is delivered again, and the rest of the
    // stream arrives while they run. C is killed with kill -9 mid-stream (offsets
    // committed every 100 ms, so it dies with work in flight) and D, empty too, joins.
    let restored = RESTORED;
    let (b, b_log) = start("b", "100ms");
    let (cc, c_log) = start("c", "100ms");
    let (head, tail) = second.split_at(second.len() / 2);
    produce(&c.bootstrap, &t, head);
    wait_showing("C to process", Duration::from_secs(90), &c_log, || {
        released_at_least(&c_log, 500)
    });
    produce(&c.bootstrap, &t, tail);
    drop(cc); // SIGKILL
    let (d, d_log) = start("d", "100ms");
    wait_showing(
        "D to get partitions",
        Duration::from_secs(60),
        &d_log,
        || log_has(&d_log, restored) > 0,
    );
    wait_until("offsets at the log end", Duration::from_secs(180), || {
        at_log_end(&c.bootstrap, &group, &t)
    });
    let restores_before = log_has(&b_log, restored);
    let summary_d = stop_and_summary(d, &d_log);
    // D's partitions come back to B, restored over what B held of them before (or whole).
    wait_until("B to take D's partitions", Duration::from_secs(60), || {
        log_has(&b_log, restored) > restores_before
    });
    wait_until("offsets at the log end", Duration::from_secs(60), || {
        at_log_end(&c.bootstrap, &group, &t)
    });
    let summary_b = stop_and_summary(b, &b_log);
    assert!(summary_b["kafka"]["restored_changes"].as_u64().unwrap() > 0);
    let processed = |s: &serde_json::Value| s["kafka"]["processed"].as_u64().unwrap();
    let (by_b, by_d) = (processed(&summary_b), processed(&summary_d));
    // Every processing publishes one change before it commits: one record per distinct
    // event in the changelog means no event was processed twice by the three instances
    // (A's changes published but not yet committed when it died count there too).
    // (The counter also emits a message per event: a record of its own, tombstoned once
    // relayed.)
    let records = read_to_end(&c.bootstrap, &changelog);
    let kinds = Kinds::of(&records);
    assert_eq!(
        kinds.changes, EVENTS,
        "changes published: A committed {by_a}, B processed {by_b}, D {by_d}"
    );
    let keys: std::collections::HashSet<Vec<u8>> = records
        .iter()
        .filter(|m| m.key().unwrap().len() == 24)
        .map(|m| m.key().unwrap().to_vec())
        .collect();
    assert_eq!(keys.len(), EVENTS, "one change per distinct event");
    assert_eq!(kinds.emitted.len(), EVENTS, "one emitted message per event");
    assert!(
        by_a + by_b + by_d < EVENTS as u64,
        "B and D answered duplicate for what A and C did: A {by_a}, B {summary_b}, D {summary_d}"
    );

    // B again on its own data directory: its checkpoints cover the whole changelog (moved
    // when it stopped), so it restores nothing and processes nothing.
    let (b, b_log) = start("b", "100ms");
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, restored) > 0
    });
    let again = stop_and_summary(b, &b_log);
    assert_eq!(again["kafka"]["restored_changes"], 0, "{again}");
    assert_eq!(again["kafka"]["processed"], 0, "{again}");

    // B processes 600 more events and is killed with kill -9 after committing their
    // offsets, its checkpoints not moved while it ran (1h): they stayed where its restore
    // left them, so the restart reads exactly the 600 changes published since (its own),
    // not the whole changelog.
    const MORE: usize = 600;
    let more = counter_records(EVENTS..EVENTS + MORE, false);
    let (b, b_log) = g.start_with("b", "100ms", "1h");
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, restored) > 0
    });
    produce(&c.bootstrap, &t, &more);
    wait_showing(
        "offsets at the log end",
        Duration::from_secs(60),
        &b_log,
        || at_log_end(&c.bootstrap, &group, &t),
    );
    drop(b); // SIGKILL
    let (b, b_log) = start("b", "100ms");
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, restored) > 0
    });
    let tail = stop_and_summary(b, &b_log);
    assert_eq!(
        tail["kafka"]["restored_changes"], MORE as u64,
        "only the tail after the checkpoint is read: {tail}"
    );
    assert_eq!(tail["kafka"]["processed"], 0, "{tail}");

    // Once more with checkpoints moved every 200 ms while B runs: after 400 more events
    // and two moves past the log end, a kill -9 loses nothing of the checkpoint's work and
    // the restart reads no change at all.
    const LAST: usize = 400;
    let last = counter_records(EVENTS + MORE..EVENTS + MORE + LAST, false);
    let (b, b_log) = g.start_with("b", "100ms", "200ms");
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, restored) > 0
    });
    produce(&c.bootstrap, &t, &last);
    wait_showing(
        "offsets at the log end",
        Duration::from_secs(60),
        &b_log,
        || at_log_end(&c.bootstrap, &group, &t),
    );
    wait_showing(
        "checkpoints moved to the changelog's end",
        Duration::from_secs(30),
        &b_log,
        || {
            // The end of what the shards published: the relay's tombstones of emitted
            // records come after it and are not changes.
            let mut ends: HashMap<i32, i64> = HashMap::new();
            for m in read_to_end(&c.bootstrap, &changelog) {
                let key = m.key().unwrap();
                let relays = key.len() == 17 && key[0] == b'O' && m.payload().is_none();
                if !relays {
                    let end = ends.entry(m.partition()).or_default();
                    *end = (*end).max(m.offset() + 1);
                }
            }
            let moved = checkpoints_moved(&b_log);
            ends.iter().all(|(p, end)| moved.get(p) == Some(end))
        },
    );
    drop(b); // SIGKILL
    let (b, b_log) = start("b", "100ms");
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, restored) > 0
    });
    let none = stop_and_summary(b, &b_log);
    assert_eq!(
        none["kafka"]["restored_changes"], 0,
        "the checkpoints moved while B ran cover every change: {none}"
    );
    const ALL: usize = EVENTS + MORE + LAST;
    let kinds = g.kinds();
    assert_eq!(kinds.changes, ALL, "one change per distinct event");
    assert_eq!(kinds.emitted.len(), ALL, "one emitted message per event");
    assert_eq!(
        kinds.emitted_tombstones, kinds.emitted,
        "every emitted message relayed, and its record tombstoned"
    );

    // B alone now holds every partition: exactly the claims and state they had.
    g.assert_exact("b", ALL);
}

/// Issue 14, kills aimed at rebalances: two live members of one group with
/// `changelog = true` and the non-idempotent `fixture-counter` handler, offsets committed
/// every 100 ms. Each of ten seeded rounds starts the member that is down, waits until the
/// member that runs revokes partitions for it (the group is rebalancing: the runner drains
/// and commits, the joiner restores what moves to it), and 0-250 ms later kills one of the
/// two with kill -9 — the joiner in even rounds (mid-restore or just after), the runner in
/// odd ones (mid-revoke, or with the partitions it kept in flight). At the end one member
/// holds every partition: one claim per distinct event, every order's count exactly 2, and
/// exactly one change per distinct event in the changelog (no event processed twice by the
/// two members, none lost).
/// The sum of `field=N` over a log's lines.
fn log_sum(log: &Path, field: &str) -> u64 {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.split(&format!("{field}="))
        .skip(1)
        .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Issue 17: a changelog sheds what it no longer needs. Claims expire 2 s after they are
/// processed; member A, claim-only, tombstones the record of every expired claim (one
/// tombstone per distinct event, keyed like its record), so a compacting broker drops
/// them. B, with an empty data directory, restores over the tombstones, and sends none
/// again: the compactor group's offset moved past them. C runs the non-idempotent counter
/// handler: the state its expired records wrote is published again as one snapshot per
/// order's counter and the records are tombstoned, so what a log cleaner leaves is one
/// record per order; D restores exactly that into an empty data directory and has every
/// order's count.
#[test]
fn expired_claims_leave_the_changelog_as_tombstones_and_their_state_as_snapshots() {
    let c = cluster();
    let t = topic("compact");
    let g = Members::new(&c, &t);
    const EVENTS: usize = 600;
    produce(&c.bootstrap, &t, &counter_records(0..EVENTS, true));
    let changelog = "compaction_interval = \"200ms\"\nexpiry_grace = \"0s\"";
    let kafka = "commit_interval = \"100ms\"";
    let claim_only = |name: &str| g.write_config(name, "ttl = \"2s\"", kafka, changelog);

    let (a, a_log) = g.spawn("a", &claim_only("a"));
    wait_showing("A to process", Duration::from_secs(90), &a_log, || {
        at_log_end(&c.bootstrap, &g.group, &t)
    });
    wait_showing("A's tombstones", Duration::from_secs(60), &a_log, || {
        g.published() >= 2 * EVENTS as i64
    });
    let summary_a = stop_and_summary(a, &a_log);
    assert_eq!(
        summary_a["kafka"]["processed"], EVENTS as u64,
        "{summary_a}"
    );
    assert_eq!(
        summary_a["kafka"]["changelog_tombstones"], EVENTS as u64,
        "{summary_a}"
    );
    assert_eq!(g.published(), 2 * EVENTS as i64);
    let records = read_to_end(&c.bootstrap, &g.changelog);
    let keys = |tombstones: bool| -> std::collections::BTreeSet<Vec<u8>> {
        records
            .iter()
            .filter(|m| !is_fence(m) && m.payload().is_none() == tombstones)
            .map(|m| m.key().unwrap().to_vec())
            .collect()
    };
    assert_eq!(keys(false).len(), EVENTS);
    assert_eq!(keys(true), keys(false), "one tombstone per record, by key");

    // B restores the tombstoned changelog into an empty data directory, then sends
    // nothing more: every record is behind the compactor group's offset.
    let (b, b_log) = g.spawn("b", &claim_only("b"));
    wait_showing("B to restore", Duration::from_secs(60), &b_log, || {
        log_has(&b_log, RESTORED) > 0
    });
    std::thread::sleep(Duration::from_millis(1500));
    let summary_b = stop_and_summary(b, &b_log);
    assert_eq!(
        summary_b["kafka"]["restored_changes"], EVENTS as u64,
        "{summary_b}"
    );
    assert_eq!(summary_b["kafka"]["changelog_tombstones"], 0, "{summary_b}");
    assert_eq!(g.published(), 2 * EVENTS as i64);

    // C: the counter handler writes state (`count/<order>`, two events per order). Past
    // expiry, each record's state is published again as a snapshot keyed by its item (the
    // order's counter), then the record is tombstoned.
    const MORE: usize = 100;
    let counter = format!(
        "ttl = \"2s\"\npartition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\nhandler = {:?}\nhandler_cpu_budget = \"2s\"",
        component("fixture_counter").display().to_string()
    );
    let cfg_c = g.write_config("c", &counter, kafka, changelog);
    let (cc, c_log) = g.spawn("c", &cfg_c);
    produce(
        &c.bootstrap,
        &t,
        &counter_records(EVENTS..EVENTS + MORE, false),
    );
    wait_showing("C to process", Duration::from_secs(90), &c_log, || {
        at_log_end(&c.bootstrap, &g.group, &t)
    });
    wait_showing(
        "C to tombstone its expired records",
        Duration::from_secs(60),
        &c_log,
        || log_sum(&c_log, " tombstones") >= MORE as u64,
    );
    let summary_c = stop_and_summary(cc, &c_log);
    assert_eq!(summary_c["kafka"]["processed"], MORE as u64, "{summary_c}");
    assert_eq!(
        summary_c["kafka"]["changelog_tombstones"], MORE as u64,
        "{summary_c}"
    );
    assert_eq!(log_sum(&c_log, "kept_with_state"), 0);
    // One per order, or two when its events expired in different passes.
    let snapshots = summary_c["kafka"]["changelog_snapshots"].as_u64().unwrap();
    assert!(
        (MORE as u64 / 2..=MORE as u64).contains(&snapshots),
        "{summary_c}"
    );
    // The counter emits a message per event: its record is tombstoned by the relay, or
    // by compaction with its claim's record.
    let kinds = g.kinds();
    assert_eq!(kinds.changes, EVENTS + MORE);
    assert_eq!(kinds.change_tombstones, EVENTS + MORE);
    assert_eq!(kinds.snapshots, snapshots as usize);
    assert_eq!(kinds.emitted.len(), MORE);
    assert_eq!(kinds.emitted_tombstones, kinds.emitted);

    // What a compacting broker's log cleaner leaves of that changelog: only the
    // snapshots, one per order.
    let cleaned = cleaned_changelog(&c, &g.changelog);
    assert_eq!(cleaned.len(), MORE / 2, "one record left per order");
    assert!(cleaned
        .iter()
        .all(|(_, _, k, _)| k.len() == 17 && k[0] == b'S'));

    // D restores the cleaned changelog into an empty data directory: every order's
    // counter is back, exactly 2, with no record of the messages that wrote it.
    let (restored, counts) = restore_cleaned(&c, &t, &cleaned, &counter, kafka, changelog);
    assert_eq!(restored, (MORE / 2) as u64);
    assert_eq!(counts.len(), MORE / 2, "{counts:?}");
    assert!(
        counts.iter().all(|(_, v)| v.as_slice() == b"2"),
        "{counts:?}"
    );
}

/// A changelog's records by kind (`source/kafka/changelog/`): changes (24-byte keys),
/// snapshots (`S` + 16 bytes), emitted messages (`O` + 16 bytes), and tombstones.
#[derive(Debug, Default)]
struct Kinds {
    changes: usize,
    change_tombstones: usize,
    snapshots: usize,
    fences: usize,
    emitted: std::collections::BTreeSet<Vec<u8>>,
    emitted_tombstones: std::collections::BTreeSet<Vec<u8>>,
}

impl Kinds {
    fn of(records: &[OwnedMessage]) -> Kinds {
        let mut k = Kinds::default();
        for m in records {
            let key = m.key().unwrap();
            match (key.len(), key[0], m.payload().is_some()) {
                (17, b'F', true) => k.fences += 1,
                (24, _, true) => k.changes += 1,
                (24, _, false) => k.change_tombstones += 1,
                (17, b'S', _) => k.snapshots += 1,
                (17, b'O', true) => assert!(k.emitted.insert(key.to_vec())),
                (17, b'O', false) => {
                    k.emitted_tombstones.insert(key.to_vec());
                }
                _ => panic!("a changelog record of no known kind: key {key:?}"),
            }
        }
        k
    }
}

/// Whether a changelog record is a member's fence (`F` and 16 bytes).
fn is_fence(m: &OwnedMessage) -> bool {
    m.key()
        .is_some_and(dedupd::source::kafka::changelog::is_fence_key)
}

/// A changelog record: (partition, offset, key, value).
type ChangelogRecord = (i32, i64, Vec<u8>, Vec<u8>);

/// What a compacting broker's log cleaner leaves of a changelog (the mock broker runs
/// none): per key the newest record, and nothing where that is a tombstone; in partition
/// and offset order.
fn cleaned_changelog(c: &Cluster, changelog: &str) -> Vec<ChangelogRecord> {
    type Newest = std::collections::BTreeMap<(i32, Vec<u8>), (i64, Option<Vec<u8>>)>;
    let mut newest = Newest::default();
    // Fences are left out: they mean their offsets, which re-producing the records into
    // another topic (`restore_cleaned`) would move; with no fence every value counts.
    for m in read_to_end(&c.bootstrap, changelog)
        .into_iter()
        .filter(|m| !is_fence(m))
    {
        let slot = newest
            .entry((m.partition(), m.key().unwrap().to_vec()))
            .or_insert((-1, None));
        if m.offset() > slot.0 {
            *slot = (m.offset(), m.payload().map(<[u8]>::to_vec));
        }
    }
    let mut cleaned: Vec<ChangelogRecord> = newest
        .into_iter()
        .filter_map(|((p, k), (o, v))| Some((p, o, k, v?)))
        .collect();
    cleaned.sort();
    cleaned
}

/// Produces `cleaned` to the changelog of a fresh group on an empty input topic, starts a
/// member with an empty data directory (subscriber lines `subscriber`, `[kafka]` lines
/// `kafka`, `[kafka.changelog]` lines `changelog`), and returns the changes it restored
/// and the handler state it then holds.
fn restore_cleaned(
    c: &Cluster,
    t: &str,
    cleaned: &[ChangelogRecord],
    subscriber: &str,
    kafka: &str,
    changelog: &str,
) -> (u64, Vec<dedupd::effects::StateEntry>) {
    let t2 = format!("{t}-cleaned");
    let g2 = Members::new(c, &t2);
    c.create_topic(&t2, 4);
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &c.bootstrap)
        .create()
        .unwrap();
    for (p, _, k, v) in cleaned {
        producer
            .send(
                BaseRecord::to(&g2.changelog)
                    .partition(*p)
                    .key(k)
                    .payload(v),
            )
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let cfg = g2.write_config("fresh", subscriber, kafka, changelog);
    let (fresh, log) = g2.spawn("fresh", &cfg);
    wait_showing(
        "the fresh member to restore",
        Duration::from_secs(60),
        &log,
        || log_has(&log, RESTORED) > 0,
    );
    let summary = stop_and_summary(fresh, &log);
    let ledger = Ledger::open(
        &g2.dir.path().join("fresh"),
        &Config::load(&cfg).unwrap(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let counts = ledger.state_entries("orders").unwrap();
    ledger.close().unwrap();
    (
        summary["kafka"]["restored_changes"].as_u64().unwrap(),
        counts,
    )
}

/// Issue 17: snapshots stay current while partitions move. Every order gets one event per
/// round, so its counter is written again and again by whichever member owns its
/// partition; claims expire after 1 s and compaction snapshots and tombstones every
/// 200 ms, so each round's records are compacted while members join and leave (x alone;
/// y joins; x leaves; x comes back; y leaves). At the end the changelog is cleaned as a
/// broker would, and a fresh member restoring only that has every order's count exactly
/// the number of rounds: the snapshots each owner published in turn, and nothing else of
/// the messages, hold the current state. (That a snapshot reads the current value, not
/// the one its record wrote, is checked in `tests/handlers.rs`.)
#[test]
fn snapshots_stay_current_while_partitions_move() {
    let c = cluster();
    let t = topic("snapshot-moves");
    let g = Members::new(&c, &t);
    c.create_topic(&t, 4);
    const ORDERS: usize = 60;
    const ROUNDS: usize = 6;
    let keys = ["a", "b", "c", "d", "e", "f"];
    let round = |r: usize| -> Vec<Rec<'static>> {
        (0..ORDERS)
            .map(|o| Rec {
                key: keys[o % keys.len()],
                headers: vec![("message-id", format!("e-{r}-{o}"))],
                payload: format!(r#"{{"type":"OrderPlaced","order_id":"o-{o}","n":{r}}}"#),
            })
            .collect()
    };
    let counter = format!(
        "ttl = \"1s\"\npartition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\nhandler = {:?}\nhandler_cpu_budget = \"2s\"",
        component("fixture_counter").display().to_string()
    );
    let kafka = "commit_interval = \"100ms\"";
    let changelog = "compaction_interval = \"200ms\"\nexpiry_grace = \"0s\"";
    let config = |name: &str| g.write_config(name, &counter, kafka, changelog);
    let snapshots_sent =
        |logs: &[&PathBuf]| logs.iter().map(|l| log_sum(l, " snapshots")).sum::<u64>();
    // Each round: produce, let the members process it, then let its claims expire and
    // be compacted before the membership changes.
    let play = |r: usize, logs: &[&PathBuf]| {
        let before = snapshots_sent(logs);
        produce(&c.bootstrap, &t, &round(r));
        wait_showing(
            "the round to be processed",
            Duration::from_secs(90),
            logs[0],
            || at_log_end(&c.bootstrap, &g.group, &t),
        );
        wait_showing(
            "the round's snapshots",
            Duration::from_secs(60),
            logs[0],
            || snapshots_sent(logs) >= before + ORDERS as u64,
        );
    };
    let (x, x_log) = g.spawn("x", &config("x"));
    wait_showing("x to restore", Duration::from_secs(60), &x_log, || {
        log_has(&x_log, RESTORED) > 0
    });
    play(0, &[&x_log]);
    let (y, y_log) = g.spawn("y", &config("y"));
    wait_showing(
        "y to get partitions",
        Duration::from_secs(60),
        &y_log,
        || log_has(&y_log, RESTORED) > 0,
    );
    play(1, &[&x_log, &y_log]);
    let mut summaries = vec![stop_and_summary(x, &x_log)];
    wait_showing(
        "y to take x's partitions",
        Duration::from_secs(60),
        &y_log,
        || log_has(&y_log, RESTORED) > 1,
    );
    play(2, &[&y_log]);
    let (x, x_log) = g.spawn("x", &config("x")); // its data directory again, a new log
    wait_showing(
        "x to get partitions back",
        Duration::from_secs(60),
        &x_log,
        || log_has(&x_log, RESTORED) > 0,
    );
    play(3, &[&x_log, &y_log]);
    play(4, &[&x_log, &y_log]);
    summaries.push(stop_and_summary(y, &y_log));
    wait_showing(
        "x to take y's partitions",
        Duration::from_secs(60),
        &x_log,
        || log_has(&x_log, RESTORED) > 1,
    );
    play(5, &[&x_log]);
    summaries.push(stop_and_summary(x, &x_log));
    let processed: u64 = summaries
        .iter()
        .map(|s| s["kafka"]["processed"].as_u64().unwrap())
        .sum();
    assert_eq!(processed, (ORDERS * ROUNDS) as u64, "{summaries:?}");

    let cleaned = cleaned_changelog(&c, &g.changelog);
    let (_, counts) = restore_cleaned(&c, &t, &cleaned, &counter, kafka, changelog);
    assert_eq!(counts.len(), ORDERS, "{counts:?}");
    let want = ROUNDS.to_string();
    let wrong: Vec<_> = counts
        .iter()
        .filter(|(_, v)| v.as_slice() != want.as_bytes())
        .map(|(k, v)| {
            (
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "stale or lost counts after cleaning: {wrong:?}"
    );
}

#[test]
fn counts_are_exact_after_kills_aimed_at_rebalances_between_two_members() {
    let c = cluster();
    let t = topic("rebalance-kills");
    let g = Members::new(&c, &t);
    const EVENTS: usize = 24_000;
    const ROUNDS: usize = 10;
    let recs = counter_records(0..EVENTS, true);
    let parts: Vec<&[Rec<'_>]> = recs.chunks(recs.len().div_ceil(ROUNDS + 1)).collect();
    assert_eq!(parts.len(), ROUNDS + 1);
    let names = ["x", "y"];
    produce(&c.bootstrap, &t, parts[0]);
    // x runs; y is down.
    let (x, x_log) = g.start("x", "100ms");
    wait_showing("x to restore", Duration::from_secs(60), &x_log, || {
        log_has(&x_log, RESTORED) > 0
    });
    let mut running: (usize, KillOnDrop, PathBuf) = (0, x, x_log);
    let mut kills = Vec::new();
    for round in 0..ROUNDS {
        produce(&c.bootstrap, &t, parts[round + 1]);
        let (up, _, ref up_log) = running;
        // The group settles first: the runner holds every partition (after a kill, once
        // the dead member's session timed out), so the joiner's arrival moves some.
        wait_showing(
            "the runner to hold every partition",
            Duration::from_secs(60),
            up_log,
            || {
                log_has(up_log, "kafka partition assigned")
                    - log_has(up_log, "kafka partition revoked")
                    == 4
            },
        );
        let revoked = log_has(up_log, "kafka partition revoked");
        let down = 1 - up;
        let (joiner, joiner_log) = g.start(names[down], "100ms");
        wait_showing(
            "the running member to revoke partitions for the joiner",
            Duration::from_secs(60),
            up_log,
            || log_has(up_log, "kafka partition revoked") > revoked,
        );
        let r = mix_u64((round as u64) ^ common::seed(0x4eba1));
        std::thread::sleep(Duration::from_millis(r % 250));
        if round % 2 == 0 {
            drop(joiner); // SIGKILL the joiner: it may be restoring
            kills.push(format!("{} joining", names[down]));
        } else {
            let (_, old, _) = std::mem::replace(&mut running, (down, joiner, joiner_log));
            drop(old); // SIGKILL the runner: it may be revoking
            kills.push(format!("{} running", names[up]));
        }
    }
    // The member that is down comes back; both run to the log end; then the one that ran
    // last stops and the other takes every partition.
    let (up, last, last_log) = running;
    let down = 1 - up;
    let (other, other_log) = g.start(names[down], "100ms");
    wait_showing(
        "the group at the log end",
        Duration::from_secs(180),
        &other_log,
        || at_log_end(&c.bootstrap, &g.group, &t),
    );
    let restores = log_has(&other_log, RESTORED);
    let _ = stop_and_summary(last, &last_log);
    wait_showing(
        "the other member to take every partition",
        Duration::from_secs(60),
        &other_log,
        || log_has(&other_log, RESTORED) > restores,
    );
    wait_until("the log end", Duration::from_secs(60), || {
        at_log_end(&c.bootstrap, &g.group, &t)
    });
    let _ = stop_and_summary(other, &other_log);
    eprintln!("rebalance kills: {} ({})", kills.len(), kills.join(", "));
    assert_eq!(g.kinds().changes, EVENTS, "one change per distinct event");
    g.assert_exact(names[down], EVENTS);
}

/// Issue 17: a member that lost a partition and goes on publishing for it (a "zombie":
/// paused past its session timeout, it commits the batches it had in flight before it
/// learns that the partition moved) cannot change what a restore of that partition ends
/// in. Member A owns partition 0, then B takes it over (fences it, restores); A, not
/// knowing, publishes two more changes: one overwriting a counter B wrote, one claiming a
/// message B never processed. A fresh member restoring the partition must end with B's
/// counter and without A's late claim — and so must a restart of that member from its
/// checkpoint after A published once more.
#[test]
fn a_former_owners_changes_after_the_new_owners_fence_are_skipped_by_every_restore() {
    use dedupd::ledger::changelog::{Change, ChangelogSink};
    use dedupd::ledger::Origin;
    use dedupd::source::kafka::changelog::{self, ChangelogProducer};

    let c = cluster();
    let t = topic("zombie-fence");
    let log = format!("{t}-changelog");
    c.create_topic(&log, 1);
    let k = kafka_config(&c.bootstrap);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let change = |n: u64, count: &str| {
        let mut c = Change {
            key: u128::from(n),
            id: format!("m-{n}"),
            fingerprint: n,
            processed_at_ms: now_ms + n,
            expires_at_ms: now_ms + 7 * 86_400_000,
            handler_version: 1,
            entity: None,
            state: Default::default(),
            uniques: Default::default(),
            versions: Default::default(),
            emitted: Vec::new(),
            origin: Some(Origin::Kafka {
                topic: t.as_str().into(),
                partition: 0,
                offset: n as i64,
            }),
            snapshot: false,
            record: None,
        };
        c.state
            .insert(b"count".to_vec(), Some(count.as_bytes().to_vec()));
        c
    };
    let publish = |by: &ChangelogProducer, changes: &[Change]| {
        by.publish(changes).unwrap().wait().unwrap();
    };
    let a = ChangelogProducer::new(&k, log.clone()).unwrap();
    let b = ChangelogProducer::new(&k, log.clone()).unwrap();
    let (a_epoch, b_epoch) = (a.fence(&[0]).unwrap(), {
        publish(&a, &[change(1, "1")]);
        b.fence(&[0]).unwrap()
    });
    assert!(a_epoch[0].1 < b_epoch[0].1, "{a_epoch:?} {b_epoch:?}");
    assert_eq!(b.epoch(0), Some(b_epoch[0].1));
    // B processes messages 2 and 3 (A never committed the offset of 2).
    publish(&b, &[change(2, "2"), change(3, "3")]);
    // A, a zombie now: its in-flight batch of message 2 again, and message 4.
    publish(&a, &[change(2, "2 (zombie)"), change(4, "4 (zombie)")]);

    let config = Config::parse("[[subscriber]]\nname = \"orders\"\n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let restore = |zombie_changes: u64, changes: u64| {
        let ledger = Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap();
        let sub = ledger.subscriber("orders").unwrap();
        let r = changelog::restore(&ledger, &sub, &k, &log, &[0]).unwrap();
        assert_eq!((r.fenced, r.changes), (zombie_changes, changes), "{r:?}");
        let claims: Vec<u128> = (1..=5)
            .filter(|&n| ledger.lookup("orders", n).unwrap().is_some())
            .collect();
        let counts: Vec<Vec<u8>> = ledger
            .state_entries("orders")
            .unwrap()
            .into_iter()
            .map(|(_, value)| value)
            .collect();
        ledger.close().unwrap();
        (claims, counts)
    };
    let (claims, counts) = restore(2, 3);
    assert_eq!(
        claims,
        [1, 2, 3],
        "A's late claim of message 4 is not restored"
    );
    assert_eq!(counts, [b"3".to_vec()], "B's counter, not A's late write");

    // A publishes once more; the restart restores from its checkpoint, which kept B's
    // fence: A's change is skipped there too.
    publish(&a, &[change(5, "5 (zombie)")]);
    let (claims, counts) = restore(1, 0);
    assert_eq!(claims, [1, 2, 3]);
    assert_eq!(counts, [b"3".to_vec()]);
}

/// The sum of `fenced=` over a member's "partitions restored" lines.
fn fenced_in(log: &Path) -> u64 {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(RESTORED))
        .filter_map(|l| l.split("fenced=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Issue 17, end to end: a real zombie. Member A runs the non-idempotent counter handler
/// and is stopped with SIGSTOP mid-stream, its batches in flight; past its session timeout
/// B takes every partition over (fences them, restores A's changes, processes the rest).
/// A is then continued: it finishes the batches it had in flight and publishes their
/// changes — after B's fences — before librdkafka tells it that its assignment was lost;
/// it rejoins and takes some partitions back. A fresh member D restores the whole
/// changelog: every order's count is exactly 2 and every event has one claim, as in B's
/// data directory, and D's restore skipped A's late changes.
#[test]
fn a_member_continued_after_its_session_expired_cannot_change_what_restores_end_in() {
    const FIRST: usize = 2_000;
    const EVENTS: usize = 24_000;
    let c = cluster();
    let t = topic("zombie");
    c.create_topic(&t, 4);
    let g = Members::new(&c, &t);
    let (a, a_log) = g.start("a", "100ms");
    wait_showing("A to restore", Duration::from_secs(60), &a_log, || {
        log_has(&a_log, RESTORED) > 0
    });
    produce(&c.bootstrap, &t, &counter_records(0..FIRST, false));
    wait_showing(
        "A to process the first events",
        Duration::from_secs(120),
        &a_log,
        || released_at_least(&a_log, FIRST as u64),
    );
    // The rest arrives at once; A is stopped while it works through them, as soon as
    // its changelog grows.
    let changelog_end = || -> i64 {
        committed_and_end(&c.bootstrap, &g.group, &g.changelog)
            .iter()
            .map(|(_, end)| end)
            .sum()
    };
    // Once the relay's tombstones of the first events are in too.
    let mut before = changelog_end();
    wait_until("the changelog to settle", Duration::from_secs(60), || {
        std::thread::sleep(Duration::from_millis(300));
        let now = changelog_end();
        std::mem::replace(&mut before, now) == now
    });
    produce(&c.bootstrap, &t, &counter_records(FIRST..EVENTS, false));
    wait_until("A to take the rest", Duration::from_secs(60), || {
        changelog_end() > before + 100
    });
    let signal = |child: &KillOnDrop, sig: &str| {
        let status = Command::new("kill")
            .args([sig, &child.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    signal(&a, "-STOP");
    let (b, b_log) = g.start("b", "100ms");
    wait_showing(
        "B to take every partition over and process the rest",
        Duration::from_secs(180),
        &b_log,
        || log_has(&b_log, RESTORED) > 0 && at_log_end(&c.bootstrap, &g.group, &t),
    );
    signal(&a, "-CONT");
    wait_showing(
        "A to learn that its assignment was lost and restore again",
        Duration::from_secs(120),
        &a_log,
        || log_has(&a_log, "kafka assignment lost") > 0 && log_has(&a_log, RESTORED) > 1,
    );
    wait_showing(
        "the group at the log end",
        Duration::from_secs(60),
        &b_log,
        || at_log_end(&c.bootstrap, &g.group, &t),
    );
    let (summary_a, summary_b) = (stop_and_summary(a, &a_log), stop_and_summary(b, &b_log));
    g.assert_exact("b", EVENTS);

    let (d, d_log) = g.start("d", "100ms");
    wait_showing("D to restore", Duration::from_secs(120), &d_log, || {
        log_has(&d_log, RESTORED) > 0
    });
    let summary_d = stop_and_summary(d, &d_log);
    assert_eq!(summary_d["kafka"]["processed"], 0, "{summary_d}");
    let fenced = fenced_in(&d_log);
    assert!(
        fenced > 0,
        "A published nothing after B's fences (A {summary_a}, B {summary_b})"
    );
    g.assert_exact("d", EVENTS);
}
