//! The RabbitMQ source against a real `rabbitmq-server` (Debian's package, 3.10;
//! `scripts/test` installs it), started by the tests on free loopback ports with its node
//! name, cookie, database and logs in a temporary directory: end to end over two queues
//! with duplicates and redeliveries, a poison message rejected to a dead-letter queue,
//! kill -9 rounds of `dedupd run` with the non-idempotent counter handler, the server
//! killed and restarted under load, a slow handler outliving the server's
//! `consumer_timeout`, `config check` of a bad section, TLS (`amqps://` with a client
//! certificate; a wrong CA and a missing client certificate refused, and said why), and
//! two instances fed by a consistent-hash exchange on `message_id`, one queue each.
//!
//! A server takes seconds to start, so the tests that do not stop it or change its
//! settings share one (each with queues of its own); it stops when the last of them ends,
//! or when the test process dies (a watcher kills its process group).
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;
mod rabbitmq_server;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::source::rabbitmq::{self, RabbitMqSummary};

use common::broker::{
    assert_counts_exact, claims, config_check, dedupd_run, free_port, handler_lines, http_get,
    last_logged, logged_with_certificate, refused_over_tls, run_source_until, start_source,
    stop_gracefully, wait_logged, wait_until, KillRounds,
};
use common::component;
use common::stall::StallingRelay;
use common::tls::Pki;
use rabbitmq_server::{shared_server, Broker, Got, Msg, RabbitServer};

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
    let handler = handler_lines(handler, "5s");
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

/// Runs the source in this process until `done` (asked from 300 ms on), then stops it;
/// returns its summary and the ledger.
fn run_until(
    config: &Config,
    data: &Path,
    done: impl Fn(&Ledger) -> bool,
) -> (RabbitMqSummary, Ledger) {
    let r = config.rabbitmq.clone().unwrap();
    run_source_until(
        config,
        data,
        Duration::from_secs(90),
        |ledger, shutdown| rabbitmq::run(ledger, &r, shutdown),
        done,
    )
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

/// A stop while the server answers nothing (the path to it went silent, the connection
/// still open) ends within the drain timeout and a few seconds: each wait for the server
/// at a stop is bounded (`STOP_REPLY`, 2 s). Before, the stop waited for a cancel-ok, a
/// close-ok or a publisher confirm for ever, and `dedupd run` ended only by its watchdog,
/// exit 1 (seen once in the kill -9 rounds, 2026-12-07). The run loop's report of the
/// queue's length (a passive declare every 5 s) waited for its answer for ever too, and
/// the stop was not even noticed (seen once in a loaded run of the suite); it is bounded
/// by the same 2 s.
#[test]
fn a_stop_while_the_server_answers_nothing_ends_in_seconds() {
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let q = "silent-stop";
    broker.declare(q, None);
    broker.publish(q, &order_msgs(0..50), &[]);
    let port = server
        .uri
        .rsplit(':')
        .next()
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let relay = StallingRelay::start(port.parse().unwrap());
    let uri = format!("amqp://127.0.0.1:{}/%2f", relay.port);
    let text = config_text(&uri, None, &[q], "").replace("\"10s\"", "\"1s\"");
    let config = Config::parse(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let r = config.rabbitmq.clone().unwrap();
    let running = start_source(&config, &dir.path().join("data"), move |l, s| {
        rabbitmq::run(l, &r, s)
    });
    wait_until("the messages claimed", Duration::from_secs(60), || {
        claims(&running.ledger) == 50
    });
    relay.stall();
    // Longer than the queue's report interval (5 s): a passive declare goes out into the
    // silence before the stop, as one did in a loaded run of the suite by chance.
    std::thread::sleep(Duration::from_secs(6));
    let (summary, took) = running.stop_timed(Duration::from_secs(20));
    assert!(took < Duration::from_secs(12), "the stop took {took:?}");
    assert_eq!(summary.unwrap().processed, 50);
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

/// How many messages the log's last `rabbitmq progress` line says were acknowledged.
fn acked_in_log(log: &Path) -> u64 {
    last_logged(log, "rabbitmq progress", "acked").unwrap_or(0)
}

/// The `[rabbitmq.outbox]` section relaying to `exchange`.
fn outbox_section(exchange: &str) -> String {
    format!("\n[rabbitmq.outbox]\nenabled = true\nexchange = \"{exchange}\"\n")
}

/// What the counter handler emitted for `events` events (`order_msgs`: two per order,
/// counted 1 then 2) arrived: every emitted id at least once (copies only of a row
/// published again after a crash, each the same), each order's counts 1 and 2 once.
fn assert_emitted_once_each(got: &[Got], events: usize) {
    let mut by_id: BTreeMap<&str, &Got> = BTreeMap::new();
    for g in got {
        let id =
            g.id.as_deref()
                .expect("a message_id on every relayed message");
        if let Some(first) = by_id.insert(id, g) {
            assert_eq!(first, g, "copies of one emitted id differ");
        }
    }
    assert_eq!(by_id.len(), events, "emitted messages lost or made up");
    let mut counts: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for g in by_id.values() {
        let key = g.key.as_deref().expect("the emitted key as dedupd-key");
        counts.entry(key).or_default().push(&g.payload);
    }
    assert_eq!(
        counts.len(),
        events / 2,
        "orders missing from the emitted messages"
    );
    for (order, mut c) in counts {
        c.sort_unstable();
        assert_eq!(c, ["1", "2"], "order {order}");
    }
}

/// `dedupd run` on RabbitMQ with the non-idempotent `fixture-counter` handler
/// (`count/<order>` = get + 1, one emitted message per event), killed with kill -9 in six
/// seeded rounds (half of them just after acknowledgements were sent); every tenth event
/// is published again. Afterwards every order's count is exactly 2 and the queue holds
/// nothing ready or unacknowledged: an ack sent before its effect was durable would lose
/// the effect (a count of 1), an effect applied twice would make a 3. The outbox relay
/// publishes to an exchange meanwhile: every emitted message arrives (copies only of the
/// same message, by id) and the outbox is empty at the end.
#[test]
fn counts_are_exact_after_kill_9_rounds_on_rabbitmq() {
    const EVENTS: usize = 6_000;
    const ROUNDS: usize = 6;
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let q = "kill9";
    broker.declare(q, None);
    let (exchange, emitted) = ("kill9.emitted", "kill9-counted");
    broker.direct(exchange, emitted, Some("counted"));
    let parts = common::broker::events_with_repeats(EVENTS, ROUNDS, order_msgs);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("dedupd.toml");
    let handler = component("fixture_counter");
    let text = config_text(&server.uri, Some(&handler), &[q], "") + &outbox_section(exchange);
    std::fs::write(&cfg, text).unwrap();
    let log = dir.path().join("run.log");
    let rounds = KillRounds {
        cfg: &cfg,
        data: &data,
        log: &log,
        started: "rabbitmq consumer started",
        seed: 0x7ab1,
    };
    let acked_at_kills = rounds.run(&parts, |part| broker.publish(q, part, &[]), acked_in_log);
    broker.publish(q, &parts[ROUNDS], &[]);
    let child = rounds.start();
    wait_logged(
        "every message acknowledged",
        Duration::from_secs(180),
        Some(&log),
        || server.pending(q) == (0, 0),
    );
    let summary = stop_gracefully(child, &log);
    eprintln!("acked at the kills: {acked_at_kills:?}; last run: {summary}");
    let config = Config::load(&cfg).unwrap();
    assert_counts_exact(&data, &config, EVENTS);
    assert_all_acked(&broker, q);
    let got = broker.drain(emitted);
    eprintln!("emitted messages relayed: {}", got.len());
    assert_emitted_once_each(&got, EVENTS);
    let ledger = Ledger::open(&data, &config, Arc::new(SystemClock)).unwrap();
    assert!(
        ledger.outbox_pending(10).unwrap().is_empty(),
        "rows left in the outbox"
    );
    ledger.close().unwrap();
}

/// A relayed message no queue takes (the exchange has no binding for the topic) comes
/// back, since it is published `mandatory`: its row stays in the outbox and the run says
/// so. Once a queue is bound, the next run publishes every row, with publisher confirms,
/// and empties the outbox.
#[test]
fn an_emitted_message_no_queue_takes_stays_in_the_outbox_until_one_does() {
    const EVENTS: usize = 40;
    let server = shared_server();
    let broker = Broker::connect(&server.uri);
    let (q, exchange, emitted) = ("unroutable", "unroutable.emitted", "unroutable-counted");
    broker.declare(q, None);
    broker.direct(exchange, emitted, None);
    broker.publish(q, &order_msgs(0..EVENTS), &[]);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let handler = component("fixture_counter");
    let text = config_text(&server.uri, Some(&handler), &[q], "")
        .replace("drain_timeout = \"10s\"", "drain_timeout = \"1s\"")
        + &outbox_section(exchange);
    let config = Config::parse(&text).unwrap();
    let processed = |ledger: &Ledger| claims(ledger) == EVENTS as u64;
    let (summary, ledger) = run_until(&config, &data, |ledger| {
        processed(ledger) && ledger.outbox_pending(100).unwrap().len() == EVENTS
    });
    assert!(summary.outbox_refused > 0, "{summary:?}");
    assert_eq!(summary.outbox_relayed, 0, "{summary:?}");
    assert_eq!(
        ledger.outbox_pending(100).unwrap().len(),
        EVENTS,
        "rows kept"
    );
    ledger.close().unwrap();
    assert!(broker.drain(emitted).is_empty());

    broker.direct(exchange, emitted, Some("counted"));
    let (summary, ledger) = run_until(&config, &data, |ledger| {
        ledger.outbox_pending(1).unwrap().is_empty()
    });
    assert_eq!(summary.outbox_relayed, EVENTS as u64, "{summary:?}");
    ledger.close().unwrap();
    assert_emitted_once_each(&broker.drain(emitted), EVENTS);
}

/// `dedupd config check` names the field of a bad `[rabbitmq]` section and accepts a good
/// one without connecting (no server runs here).
#[test]
fn config_check_names_the_bad_rabbitmq_field() {
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| config_check(dir.path(), text);
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
    let child = dedupd_run(&cfg, &dir.path().join("data"), &log);
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
    let summary = stop_gracefully(child, &log);
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

/// A node with an `amqps://` listener on a port of its own beside the plain one (the
/// test's client publishes and inspects over that): its certificate is signed by the test
/// CA for `localhost` and `127.0.0.1`, and it requires a client certificate signed by the
/// same CA (mutual TLS). Returns the node and the TLS port.
fn tls_server(pki: &Pki) -> (RabbitServer, u16) {
    let port = free_port();
    let conf = format!(
        "listeners.ssl.default = 127.0.0.1:{port}\n\
         ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
         ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n",
        pki.ca.display(),
        pki.server_cert.display(),
        pki.server_key.display()
    );
    (RabbitServer::start_conf(&[], &conf), port)
}

/// [`config_text`] for `amqps://HOST:PORT` with the CA file `ca` and, with `client`, the
/// test's client certificate and key.
fn tls_config_text(host: &str, port: u16, q: &str, ca: &Path, pki: Option<&Pki>) -> String {
    let mut tls = format!("tls_ca_file = {:?}\n", ca.display().to_string());
    if let Some(pki) = pki {
        tls += &format!(
            "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
            pki.client_cert.display().to_string(),
            pki.client_key.display().to_string()
        );
    }
    config_text(&format!("amqps://{host}:{port}/%2f"), None, &[q], "")
        .replace("drain_timeout", &format!("{tls}drain_timeout"))
}

/// TLS against the real server: dedupd consumes over `amqps://` with a client certificate
/// (the server requires one), first by the address `127.0.0.1`, then by the name
/// `localhost` (both in the certificate's names). The server lists dedupd's connection as
/// TLS with the client certificate's subject; each event is processed once over the two
/// runs and every message is acknowledged.
#[test]
fn each_event_is_processed_once_over_amqps_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path());
    let (server, port) = tls_server(&pki);
    let broker = Broker::connect(&server.uri);
    let q = "tls";
    broker.declare(q, None);
    let mut msgs = order_msgs(0..200);
    msgs.extend(order_msgs(50..100));
    broker.publish(q, &msgs, &[]);
    let tls_client = |rows: Vec<Vec<String>>| {
        rows.iter().any(|r| {
            r[0] == port.to_string() && r[1] == "true" && r[2].contains("CN=dedupd-client")
        })
    };

    let data = dir.path().join("data");
    let text = tls_config_text("127.0.0.1", port, q, &pki.ca, Some(&pki));
    let config = Config::parse(&text).unwrap();
    let (summary, ledger) = run_until(&config, &data, |l| {
        claims(l) == 200
            && broker.ready(q).0 == 0
            && tls_client(server.connections(&["port", "ssl", "peer_cert_subject"]))
    });
    eprintln!("{summary:?}");
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (200, 50, 250),
        "{summary:?}"
    );
    assert_eq!(summary.reconnects, 0, "{summary:?}");
    ledger.close().unwrap();
    assert_all_acked(&broker, q);

    broker.publish(q, &order_msgs(150..300), &[]);
    let text = tls_config_text("localhost", port, q, &pki.ca, Some(&pki));
    let config = Config::parse(&text).unwrap();
    let (summary, ledger) = run_until(&config, &data, |l| {
        claims(l) == 300 && broker.ready(q).0 == 0
    });
    eprintln!("{summary:?}");
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (100, 50, 150),
        "{summary:?}"
    );
    assert_eq!(claims(&ledger), 300);
    ledger.close().unwrap();
    assert_all_acked(&broker, q);
}

/// `dedupd run` on `amqps://` that cannot make a TLS connection: with a CA that did not
/// sign the server's certificate, and with the right CA but no client certificate (the
/// server requires one). Each time `/readyz` says 503 within seconds, its reason and the
/// log say why (a certificate), the source keeps retrying without hanging, the run stops
/// cleanly on SIGTERM and nothing was taken from the queue.
#[test]
fn amqps_with_a_wrong_ca_or_no_client_certificate_is_not_ready_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path());
    let (server, port) = tls_server(&pki);
    let broker = Broker::connect(&server.uri);
    let q = "tls-refused";
    broker.declare(q, None);
    broker.publish(q, &order_msgs(0..10), &[]);
    for (case, text) in [
        (
            "wrong CA",
            tls_config_text("127.0.0.1", port, q, &pki.other_ca, Some(&pki)),
        ),
        (
            "no client certificate",
            tls_config_text("127.0.0.1", port, q, &pki.ca, None),
        ),
    ] {
        let seen = refused_over_tls(dir.path(), case, &text);
        assert!(
            seen.readyz
                .contains("cannot connect to the RabbitMQ server"),
            "{}",
            seen.readyz
        );
        assert!(
            logged_with_certificate(&seen.log, "cannot connect to RabbitMQ"),
            "{case}: {}",
            seen.log
        );
        assert_eq!(
            seen.summary["rabbitmq"]["received"], 0,
            "{case}: {}",
            seen.summary
        );
        assert_eq!(broker.ready(q), (10, 0), "{case}: the messages wait");
    }
}

/// Events `range`, each its own order (`order_id` = `o-<n>`): the counter handler's count
/// of an order is then how many times its one event had an effect.
fn single_event_orders(range: impl Iterator<Item = usize>) -> Vec<Msg> {
    range
        .map(|n| Msg {
            id: Some(format!("e-{n}")),
            payload: format!(r#"{{"type":"OrderPlaced","order_id":"o-{n}","n":{n}}}"#),
        })
        .collect()
}

/// Several instances on RabbitMQ, the supported way (docs/rabbitmq.md, "Several
/// instances"): a consistent-hash exchange (plugin `rabbitmq_consistent_hash_exchange`)
/// hashes the `message_id` property onto one queue per instance, and each `dedupd run`
/// consumes its own queue into its own data directory, with the non-idempotent counter
/// handler. Producer retries (copies with the same `message_id`, published with the
/// originals and again after they were processed) and the redeliveries of a consumer that
/// died holding messages all reach the instance that saw the id first. Afterwards each
/// event had its effect exactly once across both instances (every count is 1, no order
/// counted in both ledgers), both instances got a share, every copy was a duplicate, every
/// message was acknowledged and both queues are empty.
#[test]
fn two_instances_behind_a_consistent_hash_exchange_process_each_id_once() {
    const EVENTS: usize = 600;
    const LATER: usize = 200;
    let server = RabbitServer::start_plugins(&["rabbitmq_consistent_hash_exchange"]);
    let broker = Broker::connect(&server.uri);
    let (exchange, queues) = ("orders", ["orders-1", "orders-2"]);
    // The server is not restarted here: a restart of rabbitmq-server 3.10.8 rebuilt the
    // exchange's ring with every id on the other queue (docs/rabbitmq.md).
    broker.consistent_hash(exchange, &queues);
    // The originals, each fifth retried by its producer at once.
    let mut first = single_event_orders(0..EVENTS);
    first.extend(single_event_orders((0..EVENTS).step_by(5)));
    broker.publish_to(exchange, "orders.placed", &first, &[]);
    let (a, b) = (broker.ready(queues[0]).0, broker.ready(queues[1]).0);
    assert_eq!(
        (a + b) as usize,
        first.len(),
        "every message routed to one queue"
    );
    // A consumer that dies holding messages of the first queue: delivered again.
    broker.take_without_ack(queues[0], 20);

    let dir = tempfile::tempdir().unwrap();
    let handler = component("fixture_counter");
    let instances: Vec<_> = queues
        .iter()
        .map(|q| {
            let run = dir.path().join(q);
            std::fs::create_dir_all(&run).unwrap();
            let cfg = run.join("dedupd.toml");
            std::fs::write(&cfg, config_text(&server.uri, Some(&handler), &[q], "")).unwrap();
            let log = run.join("run.log");
            let child = dedupd_run(&cfg, &run.join("data"), &log);
            (run, cfg, log, child)
        })
        .collect();
    let all_acked = |server: &RabbitServer| queues.iter().all(|q| server.pending(q) == (0, 0));
    wait_logged(
        "the first messages acknowledged",
        Duration::from_secs(60),
        Some(&instances[0].2),
        || all_acked(&server),
    );
    // Producer retries after the originals were processed (each third), and new events.
    let mut later = single_event_orders((0..EVENTS).step_by(3));
    later.extend(single_event_orders(EVENTS..EVENTS + LATER));
    broker.publish_to(exchange, "orders.placed", &later, &[]);
    wait_logged(
        "every message acknowledged",
        Duration::from_secs(60),
        Some(&instances[1].2),
        || all_acked(&server),
    );

    let events = (EVENTS + LATER) as u64;
    let copies = (first.len() + later.len()) as u64 - events;
    let mut counted: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut totals = [0u64; 4];
    for (i, (run, cfg, log, child)) in instances.into_iter().enumerate() {
        let summary = stop_gracefully(child, &log);
        eprintln!("instance {}: {summary}", i + 1);
        let r = &summary["rabbitmq"];
        let n = |f: &str| r[f].as_u64().unwrap();
        assert!(
            n("processed") > 0,
            "instance {} got no share: {summary}",
            i + 1
        );
        assert_eq!(n("processed") + n("duplicate"), n("received"), "{summary}");
        assert_eq!(n("acked"), n("received"), "{summary}");
        assert_eq!((n("rejected"), n("reconnects")), (0, 0), "{summary}");
        for (t, f) in totals
            .iter_mut()
            .zip(["processed", "duplicate", "acked", "redelivered"])
        {
            *t += n(f);
        }
        let config = Config::load(&cfg).unwrap();
        let ledger = Ledger::open(&run.join("data"), &config, Arc::new(SystemClock)).unwrap();
        assert_eq!(
            claims(&ledger),
            n("processed"),
            "one claim per event processed here"
        );
        for (k, v) in ledger.state_entries("orders").unwrap() {
            let (k, v) = (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap());
            if let Some((other, _)) = counted.insert(k.clone(), (i, v)) {
                panic!("{k} counted by both instances ({other} and {i})");
            }
        }
        ledger.close().unwrap();
    }
    let [processed, duplicate, acked, redelivered] = totals;
    assert_eq!(
        processed, events,
        "each event processed once across the instances"
    );
    assert_eq!(
        duplicate, copies,
        "every copy a duplicate where its original was"
    );
    assert_eq!(acked, events + copies, "every message acknowledged");
    assert!(redelivered >= 20, "the dead consumer's messages came again");
    assert_eq!(counted.len(), EVENTS + LATER, "orders lost");
    let wrong: Vec<_> = counted
        .iter()
        .filter(|(_, (_, v))| v != "1")
        .take(5)
        .collect();
    assert!(wrong.is_empty(), "effects applied twice or lost: {wrong:?}");
    for q in queues {
        assert_all_acked(&broker, q);
    }
}
