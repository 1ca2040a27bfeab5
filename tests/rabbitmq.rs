//! The RabbitMQ source against a real `rabbitmq-server` (Debian's package, 3.10;
//! `scripts/test` installs it), started by the tests on free loopback ports with its node
//! name, cookie, database and logs in a temporary directory: end to end over two queues
//! with duplicates and redeliveries, a poison message rejected to a dead-letter queue,
//! kill -9 rounds of `dedupd run` with the non-idempotent counter handler, the server
//! killed and restarted under load, a slow handler outliving the server's
//! `consumer_timeout`, and `config check` of a bad section.
//!
//! A server takes seconds to start, so the tests that do not stop it or change its
//! settings share one (each with queues of its own); it stops when the last of them ends,
//! or when the test process dies (a watcher kills its process group).
#![allow(clippy::unwrap_used)]

mod common;
mod rabbitmq_server;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::pipeline::{Cause, Shutdown};
use dedupd::source::rabbitmq::{self, RabbitMqSummary};

use common::component;
use rabbitmq_server::{
    free_port, shared_server, wait_logged, wait_until, Broker, Msg, RabbitServer,
};

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

/// A config whose subscriber `orders` reads `queues` (the first with `first_extra`).
fn config_text(uri: &str, handler: Option<&Path>, queues: &[&str], first_extra: &str) -> String {
    let handler = handler
        .map(|h| {
            format!(
                "partition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\nhandler = {:?}\nhandler_cpu_budget = \"5s\"\n",
                h.display().to_string()
            )
        })
        .unwrap_or_default();
    let mut text = format!(
        r#"
[ledger]
state_buffer_entries = 64

[[subscriber]]
name = "orders"
{handler}
[rabbitmq]
uri = "{uri}"
drain_timeout = "10s"
reconnect_delay_max = "500ms"
"#
    );
    for (i, q) in queues.iter().enumerate() {
        text += &format!(
            "\n[[rabbitmq.binding]]\nsubscriber = \"orders\"\nqueue = \"{q}\"\nprefetch = 256\n{}\n",
            if i == 0 { first_extra } else { "" }
        );
    }
    text
}

fn claims(ledger: &Ledger) -> u64 {
    ledger
        .report()
        .unwrap()
        .subscribers
        .iter()
        .map(|s| s.claims)
        .sum()
}

/// Runs the source in this process until `done` (asked from 300 ms on), then stops it;
/// returns its summary and the ledger.
fn run_until(
    config: &Config,
    data: &Path,
    done: impl Fn(&Ledger) -> bool,
) -> (RabbitMqSummary, Ledger) {
    let ledger = Arc::new(Ledger::open(data, config, Arc::new(SystemClock)).unwrap());
    dedupd::pipeline::install_handlers(&ledger, config).unwrap();
    let shutdown = Shutdown::new();
    let r = config.rabbitmq.clone().unwrap();
    let summary = std::thread::scope(|scope| {
        let runner = {
            let (ledger, shutdown, r) = (ledger.clone(), shutdown.clone(), &r);
            scope.spawn(move || rabbitmq::run(ledger, r, &shutdown))
        };
        std::thread::sleep(Duration::from_millis(300));
        wait_until("the stop condition", Duration::from_secs(90), || {
            shutdown.is_triggered() || done(&ledger)
        });
        shutdown.trigger(Cause::Requested);
        runner.join().unwrap()
    });
    assert_eq!(
        shutdown.cause(),
        Some(Cause::Requested),
        "the source failed: {summary:?}"
    );
    let summary = summary.unwrap();
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    (summary, ledger)
}

/// After the consumers are gone, every message the server still holds is ready again:
/// none may be left.
fn assert_all_acked(broker: &Broker, queue: &str) {
    wait_until("the consumers gone", Duration::from_secs(10), || {
        broker.ready(queue).1 == 0
    });
    assert_eq!(
        broker.ready(queue),
        (0, 0),
        "queue {queue}: messages not acknowledged"
    );
}

/// Two queues feed one subscriber: 300 events on one, 200 on the other, 100 of them the
/// same events (same `message_id`); 50 taken by a consumer that dies without
/// acknowledging (delivered again, `redelivered`). Each event is processed once, every
/// message is acknowledged, and the redeliveries are counted.
#[test]
fn each_event_is_processed_once_across_two_queues_with_redeliveries() {
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let (qa, qb) = ("e2e-a", "e2e-b");
    broker.declare(qa, None);
    broker.declare(qb, None);
    broker.publish(qa, &order_msgs(0..300), &[]);
    broker.publish(qb, &order_msgs(200..400), &[]);
    broker.take_without_ack(qa, 50);

    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(&server.uri, None, &[qa, qb], "")).unwrap();
    let (summary, ledger) = run_until(&config, &dir.path().join("data"), |l| {
        claims(l) == 400 && broker.ready(qa).0 == 0 && broker.ready(qb).0 == 0
    });
    eprintln!("{summary:?}");
    assert_eq!(summary.processed, 400, "{summary:?}");
    assert_eq!(summary.duplicate, 100, "{summary:?}");
    assert_eq!(summary.received, 500, "{summary:?}");
    assert_eq!(summary.acked, 500, "{summary:?}");
    assert_eq!(
        (
            summary.dead_letter_rejects,
            summary.rejected,
            summary.requeued
        ),
        (0, 0, 0),
        "{summary:?}"
    );
    assert!(summary.redelivered >= 50, "{summary:?}");
    assert_eq!(claims(&ledger), 400);
    ledger.close().unwrap();
    assert_all_acked(&broker, qa);
    assert_all_acked(&broker, qb);
}

/// A message with no `message_id` (the subscriber keys by it) is kept as a dead-letter
/// record and rejected to the queue's dead-letter queue, not acknowledged as processed;
/// the messages around it are acknowledged.
#[test]
fn unkeyable_message_is_rejected_to_the_dead_letter_queue() {
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let (q, dlq) = ("poison", "poison.dead");
    broker.declare(q, Some(dlq));
    let mut msgs = order_msgs(0..10);
    msgs.insert(
        5,
        Msg {
            id: None,
            payload: "poison: no id".into(),
        },
    );
    broker.publish(q, &msgs, &[]);

    let dir = tempfile::tempdir().unwrap();
    let extra = format!("dead_letter_queue = \"{dlq}\"");
    let config = Config::parse(&config_text(&server.uri, None, &[q], &extra)).unwrap();
    let (summary, ledger) = run_until(&config, &dir.path().join("data"), |l| {
        claims(l) == 10 && broker.ready(dlq).0 == 1
    });
    assert_eq!(summary.processed, 10, "{summary:?}");
    assert_eq!(
        summary.acked, 10,
        "only the keyed messages are acked: {summary:?}"
    );
    assert_eq!(
        (summary.rejected, summary.dead_letter_rejects),
        (1, 1),
        "{summary:?}"
    );
    let records = ledger
        .records(RecordKind::DeadLetter, "orders", None, 10)
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let body = &records[0].body;
    assert_eq!(body["payload"], "poison: no id", "{body}");
    assert_eq!(body["origin"], "rabbitmq:poison", "{body}");
    assert!(body["reason"].as_str().unwrap().contains("id"), "{body}");
    ledger.close().unwrap();
    assert_all_acked(&broker, q);
    assert_eq!(
        broker.ready(dlq),
        (1, 0),
        "the poison message is in the dead-letter queue"
    );
}

/// Kills a child process when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mix_u64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

/// How many messages the log's last `rabbitmq progress` line says were acknowledged.
fn acked_in_log(log: &Path) -> u64 {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(" acked=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .next_back()
        .unwrap_or(0)
}

/// `dedupd run --config CFG --data-dir DATA`, engine logs at info into `log`.
fn start_dedupd(cfg: &Path, data: &Path, log: &Path) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["run", "--config"])
            .arg(cfg)
            .arg("--data-dir")
            .arg(data)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "dedupd=info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// SIGTERM, then the exit status (must be 0) and the summary `dedupd run` prints.
fn stop_dedupd(mut child: KillOnDrop, log: &Path) -> serde_json::Value {
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut printed = String::new();
    std::io::Read::read_to_string(child.0.stdout.as_mut().unwrap(), &mut printed).unwrap();
    let exit = child.0.wait().unwrap();
    assert!(
        exit.success(),
        "graceful stop exits 0, got {exit:?}: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    serde_json::from_str(printed.trim()).unwrap()
}

/// `dedupd run` on RabbitMQ with the non-idempotent `fixture-counter` handler
/// (`count/<order>` = get + 1), killed with kill -9 in six seeded rounds (half of them just
/// after acknowledgements were sent); every tenth event is published again. Afterwards
/// every order's count is exactly 2 and the queue holds nothing ready or unacknowledged:
/// an ack sent before its effect was durable would lose the effect (a count of 1), an
/// effect applied twice would make a 3.
#[test]
fn counts_are_exact_after_kill_9_rounds_on_rabbitmq() {
    const EVENTS: usize = 6_000;
    const ROUNDS: usize = 6;
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let q = "kill9";
    broker.declare(q, None);
    let mut msgs = Vec::new();
    for n in 0..EVENTS {
        msgs.extend(order_msgs(n..n + 1));
        if n % 10 == 9 {
            msgs.extend(order_msgs(n - 7..n - 6)); // an earlier event published again
        }
    }
    let parts: Vec<&[Msg]> = msgs.chunks(msgs.len().div_ceil(ROUNDS + 1)).collect();
    assert_eq!(parts.len(), ROUNDS + 1);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("dedupd.toml");
    let handler = component("fixture_counter");
    std::fs::write(&cfg, config_text(&server.uri, Some(&handler), &[q], "")).unwrap();
    let log = dir.path().join("run.log");
    let started =
        || std::fs::read_to_string(&log).is_ok_and(|l| l.contains("rabbitmq consumer started"));
    let mut acked_at_kills = Vec::new();
    for (round, part) in parts[..ROUNDS].iter().enumerate() {
        broker.publish(q, part, &[]);
        let child = start_dedupd(&cfg, &data, &log);
        wait_logged(
            "the consumer started",
            Duration::from_secs(60),
            Some(&log),
            started,
        );
        let r = mix_u64((round as u64) ^ common::seed(0x7ab1));
        if round % 2 == 1 {
            wait_logged(
                "acknowledgements",
                Duration::from_secs(60),
                Some(&log),
                || acked_in_log(&log) > 0,
            );
            std::thread::sleep(Duration::from_millis(r % 150));
        } else {
            std::thread::sleep(Duration::from_millis(r % 400));
        }
        drop(child); // SIGKILL
        acked_at_kills.push(acked_in_log(&log));
    }
    broker.publish(q, parts[ROUNDS], &[]);
    let child = start_dedupd(&cfg, &data, &log);
    wait_logged(
        "the consumer started",
        Duration::from_secs(60),
        Some(&log),
        started,
    );
    wait_logged(
        "every message acknowledged",
        Duration::from_secs(180),
        Some(&log),
        || server.pending(q) == (0, 0),
    );
    let summary = stop_dedupd(child, &log);
    eprintln!("acked at the kills: {acked_at_kills:?}; last run: {summary}");
    assert_counts_exact(&data, &Config::load(&cfg).unwrap(), EVENTS);
    assert_all_acked(&broker, q);
}

/// One claim per distinct event and every `fixture-counter` order (two events) at 2.
fn assert_counts_exact(data: &Path, config: &Config, events: usize) {
    let ledger = Ledger::open(data, config, Arc::new(SystemClock)).unwrap();
    let counts: Vec<(Vec<u8>, Vec<u8>)> = ledger.state_entries("orders").unwrap();
    let claims = claims(&ledger);
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

/// `dedupd config check` names the field of a bad `[rabbitmq]` section and accepts a good
/// one without connecting (no server runs here).
#[test]
fn config_check_names_the_bad_rabbitmq_field() {
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| -> common::Run {
        let path: PathBuf = dir.path().join("dedupd.toml");
        std::fs::write(&path, text).unwrap();
        common::dedupd(&["config", "check", path.to_str().unwrap()])
    };
    let good = config_text(
        "amqp://127.0.0.1:1/%2f",
        None,
        &["orders"],
        "dead_letter_queue = \"orders.dead\"",
    );
    let ok = check(&good);
    ok.assert_success();
    assert!(
        ok.stdout.contains("rabbitmq   orders <- orders"),
        "{}",
        ok.stdout
    );
    assert!(ok.stdout.contains("sources    rabbitmq"), "{}", ok.stdout);
    for (bad, field) in [
        (good.replace("queue = \"orders\"", "queue = \"amq.orders\""), "rabbitmq.binding[0].queue"),
        (good.replace("prefetch = 256", "prefetch = 70000"), "prefetch"),
        (good.replace("amqp://127.0.0.1:1/%2f", "http://x"), "rabbitmq.uri"),
        (good.replace("orders.dead", "orders"), "rabbitmq.binding[0].dead_letter_queue"),
        (
            good.replace("drain_timeout", "tls_ca_file = \"/nonexistent.pem\"\ndrain_timeout"),
            "rabbitmq.tls_ca_file",
        ),
        (
            format!("{good}\n[nats]\nservers = [\"nats://127.0.0.1:1\"]\n[[nats.binding]]\nsubscriber = \"orders\"\nstream = \"S\"\ndurable = \"d\"\n"),
            "one dedupd per broker",
        ),
    ] {
        check(&bad).assert_refused(&[field]);
    }
}

/// `GET path` on `addr`: the status code and the body.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// The server killed (kill -9) while `dedupd run` works through 20,000 messages with the
/// counter handler, then started again: `/readyz` says 503 with the reason while it is down
/// and 200 once the source reconnected; the messages that were in flight come again
/// (`redelivered`, duplicates when they were durable); every event published before and
/// after is processed once (counts exact) and every message acknowledged in the end;
/// `/metrics` has the source's counters.
#[test]
fn readyz_is_503_while_rabbitmq_is_down_and_the_source_resumes_after_a_server_restart() {
    let mut server = RabbitServer::start(&[]);
    let q = "restart";
    let broker = Broker::connect(&server.uri);
    broker.declare(q, None);
    broker.publish(q, &order_msgs(0..20_000), &[]);
    drop(broker);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dedupd.toml");
    let metrics = format!("127.0.0.1:{}", free_port());
    // A small window and a handler keep messages in flight when the server dies.
    let text = config_text(&server.uri, Some(&component("fixture_counter")), &[q], "")
        .replace("prefetch = 256", "prefetch = 32");
    std::fs::write(&cfg, format!("{text}\n[metrics]\nbind = \"{metrics}\"\n")).unwrap();
    let log = dir.path().join("run.log");
    let child = start_dedupd(&cfg, &dir.path().join("data"), &log);
    let ready = || http_get(&metrics, "/readyz").0 == 200;
    wait_logged("ready", Duration::from_secs(60), Some(&log), ready);
    wait_logged(
        "some acknowledged",
        Duration::from_secs(60),
        Some(&log),
        || acked_in_log(&log) > 0,
    );

    server.kill();
    wait_logged("readyz 503", Duration::from_secs(30), Some(&log), || {
        let (status, body) = http_get(&metrics, "/readyz");
        status == 503 && body.contains("rabbitmq: ")
    });
    server.restart();
    wait_logged("ready again", Duration::from_secs(60), Some(&log), ready);
    let broker = Broker::connect(&server.uri);
    broker.publish(q, &order_msgs(20_000..20_200), &[]);
    wait_logged(
        "every message acknowledged",
        Duration::from_secs(120),
        Some(&log),
        || server.pending(q) == (0, 0),
    );
    let (status, text) = http_get(&metrics, "/metrics");
    assert_eq!(status, 200);
    for name in [
        "dedupd_rabbitmq_received_total",
        "dedupd_rabbitmq_acked_total",
        "dedupd_rabbitmq_messages_total",
        "dedupd_rabbitmq_queue_messages",
        "dedupd_rabbitmq_reconnects_total",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing:\n{text}"
        );
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("dedupd_rabbitmq_received_total")
                && l.contains("subscriber=\"orders\"")
                && l.contains("queue=\"restart\"")),
        "{text}"
    );
    let summary = stop_dedupd(child, &log);
    eprintln!("{summary}");
    let r = &summary["rabbitmq"];
    let n = |f: &str| r[f].as_u64().unwrap();
    assert!(n("reconnects") >= 1, "{summary}");
    // Killed under load: what was in flight comes again after the restart.
    assert!(n("redelivered") >= 1, "{summary}");
    // 20,200 distinct events, each processed once over the sessions.
    assert_eq!(n("processed"), 20_200, "{summary}");
    assert_eq!(n("processed") + n("duplicate"), n("received"), "{summary}");
    assert!(n("acked") >= 20_200, "{summary}");
    assert_all_acked(&broker, q);
    drop(broker);
    assert_counts_exact(
        &dir.path().join("data"),
        &Config::load(&cfg).unwrap(),
        20_200,
    );
}

/// A handler slower than the server's `consumer_timeout` (1 s here): the server closes the
/// channel and requeues the message while its first delivery is still being handled; the
/// source reconnects and gets it again (`redelivered`); the redelivery waits for the first
/// outcome and is a `duplicate`. The handler's effect happens once per message.
#[test]
fn a_slow_handler_past_the_consumer_timeout_is_redelivered_without_a_second_effect() {
    let server = RabbitServer::start(&["{consumer_timeout, 1000}", "{channel_tick_interval, 200}"]);
    let broker = Broker::connect(&server.uri);
    let q = "slow";
    broker.declare(q, None);
    broker.publish(q, &order_msgs(0..3), &[("sleep-ms", "2500")]);
    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(
        &server.uri,
        Some(&component("fixture_sleep")),
        &[q],
        "",
    ))
    .unwrap();
    let (summary, ledger) = run_until(&config, &dir.path().join("data"), |l| {
        claims(l) == 3 && server.pending(q) == (0, 0)
    });
    eprintln!("{summary:?}");
    assert!(
        summary.reconnects >= 1,
        "the server closed the channel: {summary:?}"
    );
    assert!(summary.redelivered >= 1, "{summary:?}");
    assert_eq!(summary.processed, 3, "each handled once: {summary:?}");
    assert!(summary.duplicate >= 1, "{summary:?}");
    assert_eq!(claims(&ledger), 3);
    ledger.close().unwrap();
    assert_all_acked(&broker, q);
}
