//! The NATS JetStream source against a real `nats-server` (Debian's package, 2.9 with
//! JetStream; `scripts/test` installs it), started by each test on a free port with its
//! store in a temporary directory: end to end with duplicates past the stream's own
//! duplicate window and redeliveries, a poison message, kill -9 rounds of `dedupd run`
//! with the non-idempotent counter handler, `config check` of a bad section, a stop
//! after the server went away (ends in seconds), `nats-bench` end to end, and TLS (a client certificate; a wrong CA refused, and said
//! why).
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use futures_util::StreamExt;

use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::source::nats::{self, NatsSummary};

use common::broker::{
    assert_counts_exact, assert_metrics_of_orders, claims, config_check, current_thread_runtime,
    dedupd_run, free_port, handler_lines, http_get, last_logged, run_source_until, start_source,
    stop_gracefully, wait_until, KillRounds,
};
use common::component;
use common::tls::Pki;

/// A `nats-server -js` of the test's own, killed when dropped.
struct NatsServer {
    child: Child,
    port: u16,
    url: String,
    store: tempfile::TempDir,
    /// A config file the server reads too (a `tls` block).
    conf: Option<PathBuf>,
}

fn spawn_server(port: u16, store: &Path, conf: Option<&Path>) -> Child {
    let mut cmd = Command::new("nats-server");
    if let Some(conf) = conf {
        cmd.arg("-c").arg(conf);
    }
    let child = cmd
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(store)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start nats-server (Debian package nats-server; scripts/test installs it): {e}")
        });
    wait_until("nats-server listening", Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    child
}

impl NatsServer {
    fn start() -> NatsServer {
        NatsServer::start_conf(None)
    }

    fn start_conf(conf: Option<PathBuf>) -> NatsServer {
        let port = free_port();
        let store = tempfile::tempdir().unwrap();
        NatsServer {
            child: spawn_server(port, store.path(), conf.as_deref()),
            port,
            url: format!("nats://127.0.0.1:{port}"),
            store,
            conf,
        }
    }

    /// A server whose one port takes TLS only, with a `tls` block in a config file: its
    /// certificate is signed by the test CA for `localhost` and `127.0.0.1`, and it
    /// requires a client certificate signed by the same CA (`verify`, mutual TLS).
    fn start_tls(pki: &Pki, dir: &Path) -> NatsServer {
        let conf = dir.join("nats-server.conf");
        std::fs::write(
            &conf,
            format!(
                "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n  timeout: 5\n}}\n",
                pki.server_cert.display().to_string(),
                pki.server_key.display().to_string(),
                pki.ca.display().to_string()
            ),
        )
        .unwrap();
        NatsServer::start_conf(Some(conf))
    }

    /// Kills the server (its store stays).
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port and store.
    fn restart(&mut self) {
        self.child = spawn_server(self.port, self.store.path(), self.conf.as_deref());
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The test's own client: streams, publishing, the consumer's counts.
struct Broker {
    rt: tokio::runtime::Runtime,
    js: jetstream::Context,
}

/// One message to publish: its `Nats-Msg-Id` (none: no header) and payload.
struct Msg {
    id: Option<String>,
    payload: String,
}

impl Broker {
    fn connect(url: &str) -> Broker {
        Broker::connect_with(url, async_nats::ConnectOptions::new())
    }

    /// [`Broker::connect`] over TLS with the test's client certificate.
    fn connect_tls(url: &str, pki: &Pki) -> Broker {
        let options = async_nats::ConnectOptions::new()
            .require_tls(true)
            .add_root_certificates(pki.ca.clone())
            .add_client_certificate(pki.client_cert.clone(), pki.client_key.clone());
        Broker::connect_with(url, options)
    }

    fn connect_with(url: &str, options: async_nats::ConnectOptions) -> Broker {
        let rt = current_thread_runtime();
        let js = rt.block_on(async { jetstream::new(options.connect(url).await.unwrap()) });
        Broker { rt, js }
    }

    /// A stream on `orders.>` whose own duplicate window is `window`.
    fn create_stream(&self, name: &str, window: Duration) {
        self.rt.block_on(async {
            self.js
                .create_stream(stream::Config {
                    name: name.to_string(),
                    subjects: vec!["orders.>".to_string()],
                    duplicate_window: window,
                    ..Default::default()
                })
                .await
                .unwrap();
        });
    }

    /// Publishes and waits for every `PubAck`; returns how many JetStream stored (not
    /// dropped as duplicates of its own window).
    fn publish(&self, msgs: &[Msg]) -> usize {
        self.publish_with(msgs, &[])
    }

    /// [`Broker::publish`], every message with the `extra` headers too.
    fn publish_with(&self, msgs: &[Msg], extra: &[(&str, &str)]) -> usize {
        self.rt.block_on(async {
            let mut acks = Vec::new();
            for (i, m) in msgs.iter().enumerate() {
                let mut headers = async_nats::HeaderMap::new();
                for (k, v) in extra {
                    headers.insert(*k, *v);
                }
                if let Some(id) = &m.id {
                    headers.insert("Nats-Msg-Id", id.as_str());
                }
                let subject = format!("orders.{}", i % 4);
                acks.push(
                    self.js
                        .publish_with_headers(subject, headers, m.payload.clone().into())
                        .await
                        .unwrap(),
                );
            }
            let mut stored = 0;
            for a in acks {
                if !a.await.unwrap().duplicate {
                    stored += 1;
                }
            }
            stored
        })
    }

    /// The durable consumer's (num_pending, num_ack_pending); both `MAX` while it does
    /// not exist yet.
    fn pending(&self, stream: &str, durable: &str) -> (u64, usize) {
        self.rt.block_on(async {
            let s = self.js.get_stream(stream).await.unwrap();
            let Ok(mut c) = s.get_consumer::<pull::Config>(durable).await else {
                return (u64::MAX, usize::MAX);
            };
            let info = c.info().await.unwrap();
            (info.num_pending, info.num_ack_pending)
        })
    }

    /// How many messages the stream holds.
    fn stored(&self, stream: &str) -> u64 {
        self.rt.block_on(async {
            let mut s = self.js.get_stream(stream).await.unwrap();
            s.info().await.unwrap().state.messages
        })
    }

    /// Creates the durable consumer as dedupd would (explicit acks), with `ack_wait`.
    fn create_consumer(&self, stream: &str, durable: &str, ack_wait: Duration) {
        self.rt.block_on(async {
            let s = self.js.get_stream(stream).await.unwrap();
            s.create_consumer(pull::Config {
                durable_name: Some(durable.to_string()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .unwrap();
        });
    }

    /// Takes `n` messages from the durable consumer and never acknowledges them: an
    /// instance that died holding them. The server delivers them again after AckWait.
    fn take_without_ack(&self, stream: &str, durable: &str, n: usize) {
        self.rt.block_on(async {
            let s = self.js.get_stream(stream).await.unwrap();
            let c: jetstream::consumer::PullConsumer = s.get_consumer(durable).await.unwrap();
            let mut got = 0;
            let mut batch = c.fetch().max_messages(n).messages().await.unwrap();
            while let Some(m) = batch.next().await {
                m.unwrap();
                got += 1;
            }
            assert_eq!(got, n, "messages taken");
        });
    }
}

fn order_msgs(range: std::ops::Range<usize>) -> Vec<Msg> {
    range
        .map(|n| Msg {
            id: Some(format!("e-{n}")),
            payload: format!(
                r#"{{"type":"OrderPlaced","order_id":"o-{}","n":{n}}}"#,
                n / 2
            ),
        })
        .collect()
}

const STREAM: &str = "ORDERS";
const DURABLE: &str = "dedupd-orders";

fn config_text(url: &str, handler: Option<&Path>, ack_wait: &str) -> String {
    let handler = handler_lines(handler, "2s");
    format!(
        r#"
[ledger]
state_buffer_entries = 64

[[subscriber]]
name = "orders"
{handler}
[nats]
servers = ["{url}"]
drain_timeout = "10s"

[[nats.binding]]
subscriber = "orders"
stream = "{STREAM}"
durable = "{DURABLE}"
max_ack_pending = 512
batch = 128
ack_wait = "{ack_wait}"
"#
    )
}

/// Runs the source in this process until the consumer has nothing pending or
/// unacknowledged, then stops it; returns its summary and the ledger.
fn run_until_drained(broker: &Broker, config: &Config, data: &Path) -> (NatsSummary, Ledger) {
    run_until(config, data, || broker.pending(STREAM, DURABLE) == (0, 0))
}

/// Runs the source in this process until `done` (asked from 300 ms on), then stops it.
fn run_until(config: &Config, data: &Path, done: impl Fn() -> bool) -> (NatsSummary, Ledger) {
    let nats_config = config.nats.clone().unwrap();
    run_source_until(
        config,
        data,
        Duration::from_secs(60),
        |ledger, shutdown| nats::run(ledger, &nats_config, shutdown),
        |_| done(),
    )
}

/// 400 events, 100 of them published again after the stream's own duplicate window
/// (200 ms) passed, so JetStream stores them twice; 50 taken by a client that never
/// acknowledges them (delivered again after AckWait). Each event is processed once, every
/// message is acknowledged in the end, and the redeliveries are counted.
#[test]
fn each_message_is_processed_once_and_acked_with_duplicates_past_the_stream_window() {
    let server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_millis(200));
    let first = order_msgs(0..400);
    assert_eq!(broker.publish(&first), 400);
    std::thread::sleep(Duration::from_millis(400));
    let again = order_msgs(100..200);
    assert_eq!(
        broker.publish(&again),
        100,
        "past its window JetStream stores a repeated Nats-Msg-Id again"
    );
    broker.create_consumer(STREAM, DURABLE, Duration::from_secs(1));
    broker.take_without_ack(STREAM, DURABLE, 50);

    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(&server.url, None, "1s")).unwrap();
    let (summary, ledger) = run_until_drained(&broker, &config, &dir.path().join("data"));
    assert_eq!(summary.processed, 400, "{summary:?}");
    assert_eq!(summary.duplicate, 100, "{summary:?}");
    assert_eq!(summary.acked, 500, "{summary:?}");
    assert_eq!(
        (summary.terminated, summary.rejected),
        (0, 0),
        "{summary:?}"
    );
    assert!(summary.redelivered >= 50, "{summary:?}");
    assert_eq!(claims(&ledger), 400);
    ledger.close().unwrap();
    assert_eq!(broker.pending(STREAM, DURABLE), (0, 0));
}

/// A message with no `Nats-Msg-Id` (the subscriber keys by it) is kept as a dead-letter
/// record and terminated, not acknowledged as processed; the messages around it are.
#[test]
fn unkeyable_message_is_dead_lettered_and_terminated_not_acked() {
    let server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_secs(120));
    let mut msgs = order_msgs(0..10);
    msgs.insert(
        5,
        Msg {
            id: None,
            payload: "poison: no id".into(),
        },
    );
    assert_eq!(broker.publish(&msgs), 11);

    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(&server.url, None, "30s")).unwrap();
    let (summary, ledger) = run_until_drained(&broker, &config, &dir.path().join("data"));
    assert_eq!(summary.processed, 10, "{summary:?}");
    assert_eq!(
        summary.acked, 10,
        "only the keyed messages are acked: {summary:?}"
    );
    assert_eq!(
        (summary.rejected, summary.terminated),
        (1, 1),
        "{summary:?}"
    );
    let records = ledger
        .records(RecordKind::DeadLetter, "orders", None, 10)
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let body = &records[0].body;
    assert_eq!(body["payload"], "poison: no id", "{body}");
    assert!(
        body["origin"].as_str().unwrap().starts_with("nats:ORDERS/"),
        "{body}"
    );
    assert!(body["reason"].as_str().unwrap().contains("id"), "{body}");
    assert_eq!(claims(&ledger), 10);
    ledger.close().unwrap();
    assert_eq!(broker.pending(STREAM, DURABLE), (0, 0));
}

/// How many messages the log's last `nats progress` line says were acknowledged.
fn acked_in_log(log: &Path) -> u64 {
    last_logged(log, "nats progress", "acked").unwrap_or(0)
}

/// `dedupd run` on NATS with the non-idempotent `fixture-counter` handler (`count/<order>`
/// = get + 1), killed with kill -9 in six seeded rounds (half of them just after
/// acknowledgements were sent), with a short AckWait so that what a killed run held comes
/// back quickly; the stream's own duplicate window is 100 ms (its least), so events published again
/// reach dedupd. Afterwards every order's count is exactly 2 and the consumer has nothing
/// pending or unacknowledged: an ack sent before its effect was durable would lose the
/// effect (a count of 1), an effect applied twice would make a 3.
#[test]
fn counts_are_exact_after_kill_9_rounds_on_nats() {
    const EVENTS: usize = 6_000;
    const ROUNDS: usize = 6;
    let server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_millis(100));
    let parts = common::broker::events_with_repeats(EVENTS, ROUNDS, order_msgs);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("dedupd.toml");
    let handler = component("fixture_counter");
    std::fs::write(&cfg, config_text(&server.url, Some(&handler), "2s")).unwrap();
    let log = dir.path().join("run.log");
    let rounds = KillRounds {
        cfg: &cfg,
        data: &data,
        log: &log,
        started: "nats consumer started",
        seed: 0x4a75,
    };
    let acked_at_kills = rounds.run(
        &parts,
        |part| {
            broker.publish(part);
        },
        acked_in_log,
    );
    broker.publish(&parts[ROUNDS]);
    let child = rounds.start();
    wait_until(
        "every message acknowledged",
        Duration::from_secs(180),
        || broker.pending(STREAM, DURABLE) == (0, 0),
    );
    let summary = stop_gracefully(child, &log);
    eprintln!("acked at the kills: {acked_at_kills:?}; last run: {summary}");
    assert_counts_exact(&data, &Config::load(&cfg).unwrap(), EVENTS);
    assert_eq!(broker.pending(STREAM, DURABLE), (0, 0));
}

/// `dedupd config check` names the field of a bad `[nats]` section and accepts a good one
/// without connecting (no server runs here).
#[test]
fn config_check_names_the_bad_nats_field() {
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| config_check(dir.path(), text);
    let good = config_text("nats://127.0.0.1:1", None, "30s");
    let ok = check(&good);
    ok.assert_success();
    assert!(
        ok.stdout
            .contains("nats       orders <- ORDERS/dedupd-orders"),
        "{}",
        ok.stdout
    );
    for (bad, field) in [
        (
            good.replace("\"ORDERS\"", "\"OR.DERS\""),
            "nats.binding[0].stream",
        ),
        (
            good.replace("batch = 128", "batch = 1024"),
            "nats.binding[0].batch",
        ),
        (
            good.replace("nats://127.0.0.1:1", "http://x"),
            "nats.servers",
        ),
        (
            good.replace("ack_wait = \"30s\"", "ack_wait = \"10ms\""),
            "nats.binding[0].ack_wait",
        ),
        (
            good.replace(
                "drain_timeout",
                "credentials_file = \"/nonexistent.creds\"\ndrain_timeout",
            ),
            "nats.credentials_file",
        ),
    ] {
        check(&bad).assert_refused(&[field]);
    }
}

/// `/readyz` of `dedupd run` says 503 with the reason while its NATS server is down (killed)
/// and 200 once the client reconnected; `/metrics` has the source's counters; messages published across the restart are all
/// processed once and acknowledged, and what the killed server delivers again is a
/// duplicate.
#[test]
fn readyz_is_503_while_nats_is_down_and_the_source_resumes_after_a_server_restart() {
    let mut server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_secs(120));
    assert_eq!(broker.publish(&order_msgs(0..100)), 100);
    drop(broker);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dedupd.toml");
    let metrics = format!("127.0.0.1:{}", free_port());
    std::fs::write(
        &cfg,
        format!(
            "{}\n[metrics]\nbind = \"{metrics}\"\n",
            config_text(&server.url, None, "30s")
        ),
    )
    .unwrap();
    let log = dir.path().join("run.log");
    let child = dedupd_run(&cfg, &dir.path().join("data"), &log);
    let ready = || http_get(&metrics, "/readyz").0 == 200;
    wait_until("ready", Duration::from_secs(60), ready);
    let broker = Broker::connect(&server.url);
    wait_until(
        "the first 100 acknowledged",
        Duration::from_secs(60),
        || broker.pending(STREAM, DURABLE) == (0, 0),
    );
    drop(broker);

    server.stop();
    wait_until("readyz 503", Duration::from_secs(30), || {
        let (status, body) = http_get(&metrics, "/readyz");
        status == 503 && body.contains("nats: not connected")
    });
    server.restart();
    wait_until("ready again", Duration::from_secs(60), ready);
    let broker = Broker::connect(&server.url);
    assert_eq!(broker.publish(&order_msgs(100..200)), 100);
    wait_until("the next 100 acknowledged", Duration::from_secs(60), || {
        broker.pending(STREAM, DURABLE) == (0, 0)
    });
    // The source's counters, per subscriber, on /metrics.
    let (status, text) = http_get(&metrics, "/metrics");
    assert_eq!(status, 200);
    assert_metrics_of_orders(
        &text,
        &[
            "dedupd_nats_received_total",
            "dedupd_nats_acked_total",
            "dedupd_nats_messages_total",
            "dedupd_nats_consumer_pending",
        ],
    );
    let summary = stop_gracefully(child, &log);
    // A killed nats-server may forget acknowledgements it had not written yet and
    // deliver those messages again: they are duplicates, each acknowledged once more.
    let n = &summary["nats"];
    assert_eq!(n["processed"], 200, "{summary}");
    assert_eq!(n["acked"], n["received"], "{summary}");
    assert_eq!(
        n["duplicate"].as_u64().unwrap() + 200,
        n["received"].as_u64().unwrap(),
        "{summary}"
    );
}

/// Two engines (data directories of their own) bound to one durable consumer: the server
/// spreads the messages between them, each message is processed by one of them and
/// acknowledged once.
#[test]
fn two_instances_share_one_durable_consumer_and_each_message_is_acked_once() {
    let server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_secs(120));
    broker.create_consumer(STREAM, DURABLE, Duration::from_secs(30));
    let dir = tempfile::tempdir().unwrap();
    let text = config_text(&server.url, None, "30s").replace("batch = 128", "batch = 16");
    let config = Config::parse(&text).unwrap();
    let (a, b) = std::thread::scope(|scope| {
        let run = |name: &'static str| {
            let (config, data, url) = (&config, dir.path().join(name), &server.url);
            scope.spawn(move || {
                let mine = Broker::connect(url);
                let started = Instant::now();
                run_until(config, &data, || {
                    started.elapsed() > Duration::from_secs(2)
                        && mine.pending(STREAM, DURABLE) == (0, 0)
                })
            })
        };
        let (a, b) = (run("a"), run("b"));
        // Both pull before anything is published.
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(broker.publish(&order_msgs(0..2000)), 2000);
        (a.join().unwrap(), b.join().unwrap())
    });
    let (sa, la) = a;
    let (sb, lb) = b;
    eprintln!("a: {sa:?}\nb: {sb:?}");
    assert_eq!(sa.processed + sb.processed, 2000);
    assert_eq!(sa.acked + sb.acked, 2000);
    assert!(sa.processed > 0 && sb.processed > 0, "both took messages");
    assert_eq!(claims(&la) + claims(&lb), 2000);
    la.close().unwrap();
    lb.close().unwrap();
}

/// A stop whose in-flight messages do not finish within `drain_timeout` (a handler that
/// sleeps 400 ms per message) gives them back with `Nak`; the next run gets them again
/// after `nak_delay`, each is acknowledged, and there is one claim per message.
#[test]
fn a_stop_naks_unfinished_messages_and_the_next_run_processes_each_once() {
    let server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_secs(120));
    assert_eq!(
        broker.publish_with(&order_msgs(0..8), &[("sleep-ms", "400")]),
        8
    );
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let text = config_text(&server.url, Some(&component("fixture_sleep")), "2s")
        .replace("drain_timeout = \"10s\"", "drain_timeout = \"100ms\"")
        .replace(
            "ack_wait = \"2s\"",
            "ack_wait = \"2s\"\nnak_delay = \"200ms\"",
        );
    let config = Config::parse(&text).unwrap();
    let started = Instant::now();
    let (first, ledger) = run_until(&config, &data, || {
        started.elapsed() > Duration::from_millis(1000)
    });
    ledger.close().unwrap();
    assert!(first.naked > 0, "{first:?}");
    assert_eq!(first.received, 8, "{first:?}");
    assert_eq!(first.acked + first.naked, 8, "{first:?}");
    let (second, ledger) = run_until_drained(&broker, &config, &data);
    eprintln!("first: {first:?}\nsecond: {second:?}");
    // What the first run had submitted was still decided (and committed) as its ledger
    // closed: given back, it is a duplicate now.
    assert!(second.redelivered >= first.naked, "{second:?}");
    assert_eq!(
        second.processed + second.duplicate,
        second.received,
        "{second:?}"
    );
    assert_eq!(second.acked, second.received, "{second:?}");
    assert_eq!(claims(&ledger), 8);
    ledger.close().unwrap();
    assert_eq!(broker.pending(STREAM, DURABLE), (0, 0));
}

/// A stop after the server went away (killed, as when the host it runs on goes down
/// first) ends within seconds: the client is reconnecting then and answers no flush or
/// request, so every wait for the server at a stop is bounded. Before that bound the stop
/// waited for a reconnection that never came.
#[test]
fn a_stop_after_the_server_went_away_ends_in_seconds() {
    let mut server = NatsServer::start();
    let broker = Broker::connect(&server.url);
    broker.create_stream(STREAM, Duration::from_secs(120));
    assert_eq!(broker.publish(&order_msgs(0..50)), 50);
    let text = config_text(&server.url, None, "2s")
        .replace("drain_timeout = \"10s\"", "drain_timeout = \"1s\"");
    let config = Config::parse(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let n = config.nats.clone().unwrap();
    let running = start_source(&config, &dir.path().join("data"), move |l, s| {
        nats::run(l, &n, s)
    });
    wait_until("the messages acknowledged", Duration::from_secs(60), || {
        claims(&running.ledger) == 50 && broker.pending(STREAM, DURABLE) == (0, 0)
    });
    drop(broker);
    server.stop();
    // The client notices the closed connection and starts reconnecting.
    std::thread::sleep(Duration::from_millis(500));
    let (summary, took) = running.stop_timed(Duration::from_secs(20));
    assert!(took < Duration::from_secs(12), "the stop took {took:?}");
    assert_eq!(summary.unwrap().processed, 50);
}

/// `dedupd nats-bench --json` end to end with the shipping-label handler: every phase
/// had all its messages acknowledged by the server's count, the rates are positive and
/// the ratios are the rates' ratios, and the bench deleted its streams.
#[test]
fn nats_bench_acknowledges_every_message_in_each_phase() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let handler = component("shipping_label");
    let run = common::dedupd(&[
        "nats-bench",
        "--server",
        &server.url,
        "--messages",
        "3000",
        "--window",
        "512",
        "--batch",
        "128",
        "--handler",
        handler.to_str().unwrap(),
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    run.assert_success();
    let r: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(r["params"]["messages"], 3000, "{r}");
    for phase in ["consume_only", "engine", "handler"] {
        assert_eq!(r[format!("{phase}_acked")], 3000, "{phase}: {r}");
    }
    let rate = |name: &str| {
        let v = r[format!("{name}_msgs_per_sec")].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0, "{name}: {r}");
        v
    };
    let (publish, base, engine, handler) = (
        rate("publish"),
        rate("consume_only"),
        rate("engine"),
        rate("handler"),
    );
    assert!(publish > 0.0);
    for (ratio, rate) in [("engine_ratio", engine), ("handler_ratio", handler)] {
        let got = r[ratio].as_f64().unwrap();
        assert!(
            (got - rate / base).abs() <= 1e-9 * got.max(1.0),
            "{ratio}: {r}"
        );
    }
    let broker = Broker::connect(&server.url);
    let left: Vec<String> = broker
        .rt
        .block_on(async { broker.js.stream_names().map(|n| n.unwrap()).collect().await });
    assert!(left.is_empty(), "streams left: {left:?}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "data directories left"
    );
}

/// [`config_text`] for the servers `url` with the CA file `ca`, `require_tls` and, with
/// `client`, the test's client certificate and key.
fn tls_config_text(url: &str, ca: &Path, client: Option<&Pki>) -> String {
    let mut tls = format!(
        "require_tls = true\ntls_ca_file = {:?}\n",
        ca.display().to_string()
    );
    if let Some(pki) = client {
        tls += &format!(
            "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
            pki.client_cert.display().to_string(),
            pki.client_key.display().to_string()
        );
    }
    config_text(url, None, "30s").replace("drain_timeout", &format!("{tls}drain_timeout"))
}

/// A certificate authority with its certificates, a server whose `tls` block requires a
/// client certificate, a client of it, and the test stream with duplicate window `window`.
fn tls_stream(dir: &std::path::Path, window: Duration) -> (Pki, NatsServer, Broker) {
    let pki = Pki::make(dir);
    let server = NatsServer::start_tls(&pki, dir);
    let broker = Broker::connect_tls(&server.url, &pki);
    broker.create_stream(STREAM, window);
    (pki, server, broker)
}

/// TLS against the real server (a `tls` block that requires a client certificate, so
/// every client speaks TLS): dedupd consumes by `nats://127.0.0.1` with `require_tls`,
/// then by `tls://localhost` (both in the certificate's names), with events stored again
/// past the stream's duplicate window. Each event is processed once over the two runs and
/// every message is acknowledged.
#[test]
fn each_message_is_processed_once_and_acked_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, server, broker) = tls_stream(dir.path(), Duration::from_millis(200));
    assert_eq!(broker.publish(&order_msgs(0..200)), 200);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(broker.publish(&order_msgs(50..100)), 50);

    let data = dir.path().join("data");
    let text = tls_config_text(&server.url, &pki.ca, Some(&pki));
    let config = Config::parse(&text).unwrap();
    let (summary, ledger) = run_until_drained(&broker, &config, &data);
    eprintln!("{summary:?}");
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (200, 50, 250),
        "{summary:?}"
    );
    ledger.close().unwrap();

    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(broker.publish(&order_msgs(150..300)), 150);
    let url = format!("tls://localhost:{}", server.port);
    let config = Config::parse(&tls_config_text(&url, &pki.ca, Some(&pki))).unwrap();
    let (summary, ledger) = run_until_drained(&broker, &config, &data);
    eprintln!("{summary:?}");
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (100, 50, 150),
        "{summary:?}"
    );
    assert_eq!(claims(&ledger), 300);
    ledger.close().unwrap();
    assert_eq!(broker.pending(STREAM, DURABLE), (0, 0));
}

/// `dedupd run` of the config `text` in `dir`, which must fail: waits for its exit (30 s at
/// most) and returns its log and how long it ran, asserting a non-zero exit.
fn failed_run(dir: &Path, text: &str) -> (String, Duration) {
    let cfg = dir.join("dedupd.toml");
    std::fs::write(&cfg, text).unwrap();
    let log = dir.join("run.log");
    let mut child = dedupd_run(&cfg, &dir.join("data"), &log);
    let start = Instant::now();
    let mut exit = None;
    wait_until("dedupd run to fail", Duration::from_secs(30), || {
        exit = child.0.try_wait().unwrap();
        exit.is_some()
    });
    let took = start.elapsed();
    let logged = std::fs::read_to_string(&log).unwrap();
    eprintln!("failed after {took:?}: {logged}");
    assert!(!exit.unwrap().success(), "{logged}");
    (logged, took)
}

/// `dedupd run` with a CA that did not sign the server's certificate: the source cannot
/// connect, and the run ends within seconds (the NATS source does not retry a first
/// connection) with an error naming the certificate; nothing was consumed.
#[test]
fn a_wrong_ca_fails_the_nats_run_within_seconds_naming_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, server, broker) = tls_stream(dir.path(), Duration::from_secs(120));
    assert_eq!(broker.publish(&order_msgs(0..10)), 10);
    let text = tls_config_text(&server.url, &pki.other_ca, Some(&pki));
    let (logged, _) = failed_run(dir.path(), &text);
    assert!(
        logged
            .lines()
            .any(|l| l.contains("cannot connect") && l.to_lowercase().contains("certificate")),
        "{logged}"
    );
    assert_eq!(
        broker.pending(STREAM, DURABLE),
        (u64::MAX, usize::MAX),
        "no consumer was made"
    );
}

/// `dedupd run` with the right CA but no client certificate, against a server whose `tls`
/// block requires one (`verify: true`): the run ends within seconds with an error that
/// says the server requires a client certificate and names the settings that send one;
/// no consumer was made and the stream still holds every message.
#[test]
fn no_client_certificate_fails_the_nats_run_within_seconds_saying_the_server_requires_one() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, server, broker) = tls_stream(dir.path(), Duration::from_secs(120));
    assert_eq!(broker.publish(&order_msgs(0..10)), 10);
    let text = tls_config_text(&server.url, &pki.ca, None);
    let (logged, took) = failed_run(dir.path(), &text);
    assert!(took < Duration::from_secs(15), "took {took:?}: {logged}");
    assert!(
        logged.lines().any(|l| l.contains("cannot connect")
            && l.contains("requires a client certificate")
            && l.contains("tls_cert_file")),
        "{logged}"
    );
    assert_eq!(
        broker.pending(STREAM, DURABLE),
        (u64::MAX, usize::MAX),
        "no consumer was made"
    );
    assert_eq!(broker.stored(STREAM), 10, "the messages wait in the stream");
}
