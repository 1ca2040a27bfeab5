//! The MQTT source against a real `mosquitto` (Debian's package, 2.0; `scripts/test`
//! installs it), started by each test on a free port with persistence in a temporary
//! directory: end to end over MQTT 5 with user-property keys and repeats, a poison message,
//! kill -9 rounds of `dedupd run` with the non-idempotent counter handler over MQTT 3.1.1,
//! the broker restarted under load, a slow handler cut short by a stop, a stop after the
//! broker went away (ends in seconds), a shared
//! subscription over two instances, `config check` of a bad section, and TLS (`mqtts`
//! with a client certificate; a wrong CA and a missing client certificate refused, and
//! said why).
//!
//! "Every message acknowledged" is checked the way the broker sees it: after dedupd stops,
//! a client taking over its persistent session receives nothing (the broker redelivers
//! every unacknowledged QoS 1 message to a resumed session, and sends what it queued).
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;
mod mqtt_server;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::source::mqtt::{self, MqttSummary};

use common::broker::{
    assert_counts_exact, assert_metrics_of_orders, claims, config_check, dedupd_run, free_port,
    handler_lines, http_get, last_logged, logged_with_certificate, refused_over_tls,
    run_source_until, start_source, stop_gracefully, wait_until, KillRounds,
};
use common::component;
use common::tls::Pki;
use mqtt_server::{create_session, left_in_session, publish, Mosquitto, Msg};

const CLIENT_ID: &str = "dedupd-orders";

/// Event `n` of order `n / 2`, on `orders/<n % 4>/e-<n>`, with its id in the payload and
/// in a `msg-id` user property.
fn order_msgs(range: std::ops::Range<usize>) -> Vec<Msg> {
    range
        .map(|n| Msg {
            topic: format!("orders/{}/e-{n}", n % 4),
            payload: format!(
                r#"{{"id":"e-{n}","type":"OrderPlaced","order_id":"o-{}","n":{n}}}"#,
                n / 2
            ),
            props: vec![("msg-id".into(), format!("e-{n}"))],
        })
        .collect()
}

fn config_text(url: &str, protocol: &str, key: &str, handler: Option<&Path>) -> String {
    let handler = handler_lines(handler, "2s");
    format!(
        r#"
[ledger]
state_buffer_entries = 64

[[subscriber]]
name = "orders"
key = {key}
{handler}
[mqtt]
broker = "{url}"
protocol = "{protocol}"
client_id = "{CLIENT_ID}"
receive_maximum = 100
drain_timeout = "10s"
reconnect_backoff_max = "500ms"

[[mqtt.subscription]]
subscriber = "orders"
topics = ["orders/#"]
"#
    )
}

const BY_PROPERTY: &str = r#"{ source = "header", name = "msg-id" }"#;
const BY_PAYLOAD: &str = r#"{ source = "json_pointer", pointer = "/id" }"#;

/// Runs the source in this process until `done` (asked from 300 ms on, with the ledger),
/// then stops it; returns its summary and the ledger.
fn run_until(
    config: &Config,
    data: &Path,
    done: impl Fn(&Ledger) -> bool,
) -> (MqttSummary, Ledger) {
    let mqtt_config = config.mqtt.clone().unwrap();
    run_source_until(
        config,
        data,
        Duration::from_secs(60),
        |ledger, shutdown| mqtt::run(ledger, &mqtt_config, shutdown),
        done,
    )
}

/// MQTT 5, keyed by a user property: 300 events, 100 of them published again (a
/// publisher's retry), queued in the session before dedupd starts. Each event is processed
/// once, every message is acknowledged, and nothing is left in the session.
#[test]
fn each_message_is_processed_once_and_acked_over_mqtt_5_with_repeats() {
    let broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    let mut msgs = order_msgs(0..200);
    msgs.extend(order_msgs(50..150));
    msgs.extend(order_msgs(200..300));
    publish(broker.port, &msgs);

    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(&broker.url, "5", BY_PROPERTY, None)).unwrap();
    // The last event is the last published: once it is claimed every repeat was taken.
    let (summary, ledger) = run_until(&config, &dir.path().join("data"), |l| claims(l) == 300);
    eprintln!("{summary:?}");
    assert_eq!(summary.received, 400, "{summary:?}");
    assert_eq!(summary.processed, 300, "{summary:?}");
    assert_eq!(summary.duplicate, 100, "{summary:?}");
    assert_eq!(summary.acked, 400, "{summary:?}");
    assert_eq!(
        (summary.rejected, summary.unacked_lost),
        (0, 0),
        "{summary:?}"
    );
    assert_eq!(claims(&ledger), 300);
    ledger.close().unwrap();
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
}

/// A backlog larger than the client's request channel (rumqttc, one request per packet
/// id): mosquitto 2.0.11 sends a session's queued messages faster than the connection
/// task writes the PUBACKs, past the window, and the channel fills. PUBACKs it refused
/// used to be dropped (counted `unacked_lost`, left in the session; with the broker
/// waiting for them the source stalled until a restart). They wait and go out in order.
#[test]
fn a_backlog_past_the_client_request_queue_is_acknowledged_in_full() {
    const EVENTS: usize = 150_000;
    let broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    publish(broker.port, &order_msgs(0..EVENTS));

    let dir = tempfile::tempdir().unwrap();
    // The stop waits for the queued PUBACKs to be written (tens of thousands right after
    // the backlog, slow under a busy test suite).
    let text = config_text(&broker.url, "5", BY_PROPERTY, None)
        .replace(r#"drain_timeout = "10s""#, r#"drain_timeout = "120s""#);
    let config = Config::parse(&text).unwrap();
    let mqtt_config = config.mqtt.clone().unwrap();
    let (summary, ledger) = run_source_until(
        &config,
        &dir.path().join("data"),
        Duration::from_secs(300),
        |ledger, shutdown| mqtt::run(ledger, &mqtt_config, shutdown),
        |l| claims(l) == EVENTS as u64,
    );
    assert_eq!(summary.processed, EVENTS as u64, "{summary:?}");
    assert_eq!(
        (summary.acked, summary.unacked_lost),
        (EVENTS as u64, 0),
        "every message acknowledged on its connection: {summary:?}"
    );
    assert_eq!(claims(&ledger), EVENTS as u64);
    ledger.close().unwrap();
    // Not asserted: that the session is empty now. Mosquitto 2.0.11 keeps part of such a
    // backlog after every PUBACK was written (61,846 of 150,000 in one run), and half of
    // that again after a second run acknowledged each redelivery as a duplicate: seen in
    // docs/mqtt.md ("A backlog past ~65,000 messages"), not explained yet.
}

/// MQTT 3.1.1, keyed by the payload: a message that is not JSON is kept as a dead-letter
/// record and then acknowledged (MQTT has no reject); the messages around it are
/// processed.
#[test]
fn unkeyable_message_is_dead_lettered_then_acked() {
    let broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    let mut msgs = order_msgs(0..10);
    msgs.insert(
        5,
        Msg {
            topic: "orders/9/poison".into(),
            payload: "poison: not json".into(),
            props: Vec::new(),
        },
    );
    publish(broker.port, &msgs);

    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse(&config_text(&broker.url, "3.1.1", BY_PAYLOAD, None)).unwrap();
    let (summary, ledger) = run_until(&config, &dir.path().join("data"), |l| claims(l) == 10);
    assert_eq!(summary.processed, 10, "{summary:?}");
    assert_eq!(summary.rejected, 1, "{summary:?}");
    assert_eq!(
        summary.acked, 11,
        "the dead letter is acknowledged too: {summary:?}"
    );
    let records = ledger
        .records(RecordKind::DeadLetter, "orders", None, 10)
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let body = &records[0].body;
    assert_eq!(body["payload"], "poison: not json", "{body}");
    assert_eq!(body["origin"], "mqtt:orders/9/poison", "{body}");
    assert_eq!(body["key"], "orders/9/poison", "{body}");
    assert_eq!(claims(&ledger), 10);
    ledger.close().unwrap();
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
}

/// A field of the log's last `mqtt progress` line (`acked`, `in_flight`).
fn progress_in_log(log: &Path, field: &str) -> Option<u64> {
    last_logged(log, "mqtt progress", field)
}

/// Waits until the run's log says nothing is in flight and has not changed for 2 s (the
/// session delivers what it holds at once; quiet means done, which the session check
/// after the stop then proves).
fn wait_quiet(log: &Path, timeout: Duration) {
    let mut last = (String::new(), Instant::now());
    wait_until("the run to go quiet", timeout, || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text != last.0 {
            last = (text, Instant::now());
            return false;
        }
        last.1.elapsed() > Duration::from_secs(2) && progress_in_log(log, "in_flight") == Some(0)
    });
}

/// `dedupd run` over MQTT 3.1.1 with the non-idempotent `fixture-counter` handler
/// (`count/<order>` = get + 1), keyed by a topic level, killed with kill -9 in five seeded
/// rounds (some just after acknowledgements were sent). Messages are published while
/// dedupd is down, so the session queues them; what a killed run held unacknowledged
/// comes again with DUP. Afterwards every order's count is exactly 2 and the session
/// holds nothing: an ack sent before its effect was durable would lose the effect (a count
/// of 1), an effect applied twice would make a 3.
#[test]
fn counts_are_exact_after_kill_9_rounds_on_mqtt() {
    const EVENTS: usize = 4_000;
    const ROUNDS: usize = 5;
    let broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    let parts = common::broker::events_with_repeats(EVENTS, ROUNDS, order_msgs);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("dedupd.toml");
    let handler = component("fixture_counter");
    let text = config_text(&broker.url, "3.1.1", r#"{ source = "id" }"#, Some(&handler))
        .replace("topics = [", "id_topic_level = 2\ntopics = [");
    std::fs::write(&cfg, text).unwrap();
    let log = dir.path().join("run.log");
    let rounds = KillRounds {
        cfg: &cfg,
        data: &data,
        log: &log,
        started: "mqtt subscribed",
        seed: 0x6d71,
    };
    let acked_at_kills = rounds.run(
        &parts,
        |part| publish(broker.port, part),
        |log| progress_in_log(log, "acked").unwrap_or(0),
    );
    publish(broker.port, &parts[ROUNDS]);
    let child = rounds.start();
    wait_quiet(&log, Duration::from_secs(180));
    let summary = stop_gracefully(child, &log);
    eprintln!("acked at the kills: {acked_at_kills:?}; last run: {summary}");
    // The rounds cut the stream: some run was killed holding messages it had not
    // acknowledged (sent again with DUP to the next run) or before it acknowledged all of
    // its part (left queued in the session). Which of the two a busy machine's timing
    // gives varies; the DUP path itself is checked every time by the slow-handler test.
    let part = parts[0].len() as u64;
    assert!(
        summary["mqtt"]["redelivered"].as_u64().unwrap() > 0
            || acked_at_kills.iter().any(|a| *a < part),
        "no round was cut mid-stream: {acked_at_kills:?}, {summary}"
    );
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
    assert_counts_exact(&data, &Config::load(&cfg).unwrap(), EVENTS);
}

/// The broker restarted while `dedupd run` (MQTT 5, the counter handler) works through a
/// backlog: `/readyz` says 503 with the reason while it is down and 200 once the session
/// is back; the messages it had delivered unacknowledged come again (DUP) and are
/// duplicates; messages published after the restart are processed; every order counts 2,
/// and the session holds nothing at the end. `/metrics` has the source's counters.
#[test]
fn broker_restart_under_load_loses_nothing_and_readyz_reflects_it() {
    const EVENTS: usize = 14_000;
    const BEFORE: usize = 12_000;
    let mut broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    let all = order_msgs(0..EVENTS);
    publish(broker.port, &all[..BEFORE]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dedupd.toml");
    let data = dir.path().join("data");
    let metrics = format!("127.0.0.1:{}", free_port());
    let text = config_text(
        &broker.url,
        "5",
        BY_PROPERTY,
        Some(&component("fixture_counter")),
    );
    std::fs::write(&cfg, format!("{text}\n[metrics]\nbind = \"{metrics}\"\n")).unwrap();
    let log = dir.path().join("run.log");
    let child = dedupd_run(&cfg, &data, &log);
    let ready = || http_get(&metrics, "/readyz").0 == 200;
    wait_until("ready", Duration::from_secs(60), ready);
    // The broker stops with work in flight and most of the backlog still queued.
    wait_until("some work done", Duration::from_secs(60), || {
        progress_in_log(&log, "acked").unwrap_or(0) > 0
    });

    broker.stop();
    wait_until("readyz 503", Duration::from_secs(30), || {
        let (status, body) = http_get(&metrics, "/readyz");
        status == 503 && body.contains("mqtt: not connected")
    });
    broker.restart();
    wait_until("ready again", Duration::from_secs(60), ready);
    publish(broker.port, &all[BEFORE..]);
    wait_quiet(&log, Duration::from_secs(120));
    let (status, text) = http_get(&metrics, "/metrics");
    assert_eq!(status, 200);
    assert_metrics_of_orders(
        &text,
        &[
            "dedupd_mqtt_received_total",
            "dedupd_mqtt_acked_total",
            "dedupd_mqtt_messages_total",
        ],
    );
    let summary = stop_gracefully(child, &log);
    eprintln!("{summary}");
    let m = &summary["mqtt"];
    assert!(m["connections"].as_u64().unwrap() >= 2, "{summary}");
    assert_eq!(m["processed"], EVENTS as u64, "{summary}");
    assert_eq!(
        m["processed"].as_u64().unwrap() + m["duplicate"].as_u64().unwrap(),
        m["received"].as_u64().unwrap(),
        "{summary}"
    );
    assert_eq!(
        m["acked"].as_u64().unwrap() + m["unacked_lost"].as_u64().unwrap(),
        m["received"].as_u64().unwrap(),
        "{summary}"
    );
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
    // Each order's two events: one effect each, none lost across the restart.
    let config = Config::load(&cfg).unwrap();
    let ledger = Ledger::open(&data, &config, Arc::new(SystemClock)).unwrap();
    let counts = ledger.state_entries("orders").unwrap();
    ledger.close().unwrap();
    assert_eq!(counts.len(), EVENTS / 2);
    assert!(counts.iter().all(|(_, v)| v.as_slice() == b"2"));
}

/// A stop whose in-flight messages do not finish within `drain_timeout` (a handler that
/// sleeps 400 ms per message, MQTT 5 for the `sleep-ms` property) leaves them
/// unacknowledged in the session; the next run gets them again (DUP), each is
/// acknowledged, and there is one claim (one effect) per message.
#[test]
fn a_slow_handler_cut_short_by_a_stop_has_no_double_effect() {
    let broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    let mut msgs = order_msgs(0..8);
    for m in &mut msgs {
        m.props.push(("sleep-ms".into(), "400".into()));
    }
    publish(broker.port, &msgs);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let text = config_text(
        &broker.url,
        "5",
        BY_PROPERTY,
        Some(&component("fixture_sleep")),
    )
    .replace("drain_timeout = \"10s\"", "drain_timeout = \"100ms\"");
    let config = Config::parse(&text).unwrap();
    let started = Instant::now();
    let (first, ledger) = run_until(&config, &data, |_| {
        started.elapsed() > Duration::from_millis(1000)
    });
    ledger.close().unwrap();
    assert_eq!(first.received, 8, "{first:?}");
    assert!(first.acked < 8, "{first:?}");
    // The stop drains: what is claimed by then is acknowledged before the run returns.
    let (second, ledger) = run_until(&config, &data, |l| claims(l) == 8);
    eprintln!("first: {first:?}\nsecond: {second:?}");
    assert!(second.redelivered >= 8 - first.acked, "{second:?}");
    assert_eq!(
        second.processed + second.duplicate,
        second.received,
        "{second:?}"
    );
    assert_eq!(second.acked, second.received, "{second:?}");
    assert_eq!(claims(&ledger), 8);
    ledger.close().unwrap();
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
}

/// A stop after the broker went away ends within seconds: no DISCONNECT can be written to
/// a connection that is gone, so the stop does not wait `drain_timeout` for one (before,
/// it waited the whole 20 s here; the stop watchdog of `dedupd run` allows 50).
#[test]
fn a_stop_after_the_broker_went_away_ends_in_seconds() {
    let mut broker = Mosquitto::start();
    create_session(broker.port, CLIENT_ID, "orders/#");
    publish(broker.port, &order_msgs(0..50));
    let text = config_text(&broker.url, "5", BY_PROPERTY, None)
        .replace("drain_timeout = \"10s\"", "drain_timeout = \"20s\"");
    let config = Config::parse(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = config.mqtt.clone().unwrap();
    let running = start_source(&config, &dir.path().join("data"), move |l, s| {
        mqtt::run(l, &m, s)
    });
    wait_until("the messages claimed", Duration::from_secs(60), || {
        claims(&running.ledger) == 50
    });
    // Their PUBACKs go out as the claims commit; a moment for the last ones.
    std::thread::sleep(Duration::from_millis(300));
    broker.stop();
    std::thread::sleep(Duration::from_millis(500));
    let (summary, took) = running.stop_timed(Duration::from_secs(60));
    assert!(took < Duration::from_secs(8), "the stop took {took:?}");
    assert_eq!(summary.unwrap().processed, 50);
}

/// Two engines with their own client ids and data directories on one shared subscription
/// (`$share/dedupd/orders/#`): the broker hands each message to one of them; each is
/// processed once and acknowledged once.
#[test]
fn two_instances_share_a_subscription_and_each_message_is_acked_once() {
    let broker = Mosquitto::start();
    let dir = tempfile::tempdir().unwrap();
    let text = config_text(&broker.url, "5", BY_PROPERTY, None)
        .replace("\"orders/#\"", "\"$share/dedupd/orders/#\"");
    let config_a = Config::parse(&text.replace(CLIENT_ID, "dedupd-a")).unwrap();
    let config_b = Config::parse(&text.replace(CLIENT_ID, "dedupd-b")).unwrap();
    let (a, b) = std::thread::scope(|scope| {
        let run = |config: &'static str| {
            let (cfg, data) = match config {
                "a" => (&config_a, dir.path().join("a")),
                _ => (&config_b, dir.path().join("b")),
            };
            let started = Instant::now();
            scope.spawn(move || {
                // Stops 3 s in, after both took their share (published at 1 s).
                run_until(cfg, &data, move |_| {
                    started.elapsed() > Duration::from_secs(3)
                })
            })
        };
        let (a, b) = (run("a"), run("b"));
        std::thread::sleep(Duration::from_millis(1000));
        publish(broker.port, &order_msgs(0..1000));
        (a.join().unwrap(), b.join().unwrap())
    });
    let (sa, la) = a;
    let (sb, lb) = b;
    eprintln!("a: {sa:?}\nb: {sb:?}");
    assert_eq!(sa.processed + sb.processed, 1000);
    assert_eq!(sa.acked + sb.acked, 1000);
    assert!(sa.processed > 0 && sb.processed > 0, "both took messages");
    assert_eq!(claims(&la) + claims(&lb), 1000);
    la.close().unwrap();
    lb.close().unwrap();
}

/// `dedupd config check` names the field of a bad `[mqtt]` section and accepts a good one
/// without connecting (no broker runs here).
#[test]
fn config_check_names_the_bad_mqtt_field() {
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| config_check(dir.path(), text);
    let good = config_text("mqtt://127.0.0.1:1", "5", BY_PROPERTY, None);
    let ok = check(&good);
    ok.assert_success();
    assert!(
        ok.stdout.contains("mqtt       orders <- orders/#"),
        "{}",
        ok.stdout
    );
    for (bad, field) in [
        (good.replace("mqtt://127.0.0.1:1", "tcp://x"), "mqtt.broker"),
        (
            good.replace("\"orders/#\"", "\"orders/#/x\""),
            "mqtt.subscription[0].topics",
        ),
        (
            good.replace("topics =", "qos = 2\ntopics ="),
            "mqtt.subscription[0].qos",
        ),
        (
            good.replace("protocol = \"5\"", "protocol = \"3.1.1\""),
            "mqtt.subscription[0].subscriber",
        ),
        (
            good.replace(
                "client_id =",
                "username = \"u\"\npassword_env = \"DEDUPD_TEST_UNSET_VAR\"\nclient_id =",
            ),
            "mqtt.password_env",
        ),
        (
            format!("{good}\n[nats]\nservers = [\"nats://127.0.0.1:4222\"]\n"),
            "mqtt",
        ),
    ] {
        check(&bad).assert_refused(&[field]);
    }
}

/// [`config_text`] for `mqtts://HOST:PORT` (keyed by the payload), with the CA file `ca`
/// and, with `pki`, the test's client certificate and key.
fn tls_config_text(host: &str, port: u16, protocol: &str, ca: &Path, pki: Option<&Pki>) -> String {
    let mut tls = format!("tls_ca_file = {:?}\n", ca.display().to_string());
    if let Some(pki) = pki {
        tls += &format!(
            "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
            pki.client_cert.display().to_string(),
            pki.client_key.display().to_string()
        );
    }
    config_text(
        &format!("mqtts://{host}:{port}"),
        protocol,
        BY_PAYLOAD,
        None,
    )
    .replace("client_id =", &format!("{tls}client_id ="))
}

/// TLS against the real broker: dedupd consumes its session over `mqtts` with a client
/// certificate (the listener requires one), over MQTT 5 by the address `127.0.0.1`, then
/// over MQTT 3.1.1 by the name `localhost` (both in the certificate's names); the broker
/// logs both connections on the TLS port. Each event is processed once over the two runs
/// and nothing is left in the session.
#[test]
fn each_message_is_processed_once_and_acked_over_mqtts_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path());
    let (broker, tls_port) = Mosquitto::start_tls(&pki);
    create_session(broker.port, CLIENT_ID, "orders/#");
    let mut msgs = order_msgs(0..150);
    msgs.extend(order_msgs(50..100));
    msgs.extend(order_msgs(150..200));
    publish(broker.port, &msgs);

    let data = dir.path().join("data");
    let text = tls_config_text("127.0.0.1", tls_port, "5", &pki.ca, Some(&pki));
    let config = Config::parse(&text).unwrap();
    let (summary, ledger) = run_until(&config, &data, |l| claims(l) == 200);
    eprintln!("{summary:?}");
    // The last event published is new: once it is claimed every repeat was taken.
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (200, 50, 250),
        "{summary:?}"
    );
    assert_eq!(summary.unacked_lost, 0, "{summary:?}");
    ledger.close().unwrap();

    publish(broker.port, &order_msgs(150..300));
    let text = tls_config_text("localhost", tls_port, "3.1.1", &pki.ca, Some(&pki));
    let config = Config::parse(&text).unwrap();
    let (summary, ledger) = run_until(&config, &data, |l| claims(l) == 300);
    eprintln!("{summary:?}");
    assert_eq!(
        (summary.processed, summary.duplicate, summary.acked),
        (100, 50, 150),
        "{summary:?}"
    );
    assert_eq!(claims(&ledger), 300);
    ledger.close().unwrap();
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        0
    );
    // "New connection from ADDR on port PORT." then "New client connected from ADDR as ID".
    let log = broker.log();
    let on_tls_port = format!(" on port {tls_port}.");
    let tls_peers: Vec<&str> = log
        .lines()
        .filter_map(|l| {
            l.split("New connection from ")
                .nth(1)?
                .strip_suffix(&on_tls_port)
        })
        .collect();
    let dedupd_on_tls = log
        .lines()
        .filter_map(|l| l.split("New client connected from ").nth(1))
        .filter(|l| {
            tls_peers
                .iter()
                .any(|p| l.starts_with(&format!("{p} as {CLIENT_ID} ")))
        })
        .count();
    assert_eq!(
        dedupd_on_tls, 2,
        "two dedupd connections on the TLS listener:\n{log}"
    );
}

/// `dedupd run` on `mqtts` that cannot make a TLS connection: with a CA that did not sign
/// the broker's certificate, and with the right CA but no client certificate (the
/// listener requires one). Each time `/readyz` says 503 within seconds and its reason and
/// the log say why (a certificate), the source keeps retrying without hanging, the run
/// stops cleanly on SIGTERM and the session still holds every message.
#[test]
fn mqtts_with_a_wrong_ca_or_no_client_certificate_is_not_ready_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path());
    let (broker, tls_port) = Mosquitto::start_tls(&pki);
    create_session(broker.port, CLIENT_ID, "orders/#");
    publish(broker.port, &order_msgs(0..10));
    for (case, text) in [
        (
            "wrong CA",
            tls_config_text("127.0.0.1", tls_port, "5", &pki.other_ca, Some(&pki)),
        ),
        (
            "no client certificate",
            tls_config_text("127.0.0.1", tls_port, "5", &pki.ca, None),
        ),
    ] {
        let seen = refused_over_tls(dir.path(), case, &text);
        assert!(
            seen.readyz.contains("not connected to the MQTT broker"),
            "{}",
            seen.readyz
        );
        assert!(
            logged_with_certificate(&seen.log, "mqtt connection lost"),
            "{case}: {}",
            seen.log
        );
        assert_eq!(
            seen.summary["mqtt"]["received"], 0,
            "{case}: {}",
            seen.summary
        );
    }
    assert_eq!(
        left_in_session(broker.port, CLIENT_ID, Duration::from_secs(1)),
        10,
        "the messages wait in the session"
    );
}
