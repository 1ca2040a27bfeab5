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

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::{Ledger, RecordKind};
use dedupd::pipeline::{Cause, Shutdown};
use dedupd::source::rabbitmq::{self, RabbitMqSummary};

use common::component;

/// Where Debian's package puts the scripts (`/usr/sbin/rabbitmq-server` runs them as the
/// `rabbitmq` user; the tests run them as they are, with their own directories).
const SBIN: &str = "/usr/lib/rabbitmq/bin";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    wait_logged(what, timeout, None, f);
}

/// [`wait_until`]; a timeout shows the end of `log` (a `dedupd run`'s).
fn wait_logged(what: &str, timeout: Duration, log: Option<&Path>, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        if start.elapsed() >= timeout {
            let text = log
                .map(|l| std::fs::read_to_string(l).unwrap_or_default())
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!("timed out waiting for {what}; log:\n{}", tail.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `rabbitmq-server` node of the tests' own: its epmd, ports, cookie and directories.
struct RabbitServer {
    /// The process group (`sh` leading epmd, the server and a watcher of this process).
    group: Option<Child>,
    port: u16,
    epmd_port: u16,
    dist_port: u16,
    node: String,
    dir: tempfile::TempDir,
    uri: String,
}

impl RabbitServer {
    /// Starts a node; `rabbit_env` is added to the `rabbit` application's settings
    /// (advanced.config), e.g. `{consumer_timeout, 1000}`.
    fn start(rabbit_env: &[&str]) -> RabbitServer {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        let cookie = dir.path().join("home/.erlang.cookie");
        std::fs::write(&cookie, format!("dedupdtest{}x{n}", std::process::id())).unwrap();
        std::fs::set_permissions(&cookie, std::os::unix::fs::PermissionsExt::from_mode(0o400))
            .unwrap();
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("advanced.config"),
            format!("[{{rabbit, [{}]}}].\n", rabbit_env.join(", ")),
        )
        .unwrap();
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").unwrap();
        let mut server = RabbitServer {
            group: None,
            port,
            epmd_port: free_port(),
            dist_port: free_port(),
            node: format!("dedupd-test-{}-{n}@localhost", std::process::id()),
            uri: format!("amqp://127.0.0.1:{port}/%2f"),
            dir,
        };
        server.spawn();
        server
    }

    fn env(&self, cmd: &mut Command) {
        let d = self.dir.path();
        cmd.env("HOME", d.join("home"))
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d.join("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_ENABLED_PLUGINS", "");
    }

    /// Starts the group and waits until the server takes connections.
    fn spawn(&mut self) {
        let script = format!(
            "epmd -port {epmd} & \
             until epmd -port {epmd} -names >/dev/null 2>&1; do sleep 0.1; done; \
             {SBIN}/rabbitmq-server & \
             while kill -0 {parent} 2>/dev/null; do sleep 1; done; kill -KILL 0",
            epmd = self.epmd_port,
            parent = std::process::id()
        );
        let log = std::fs::File::create(self.dir.path().join("server.out")).unwrap();
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(script)
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        self.env(&mut cmd);
        self.group = Some(cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start rabbitmq-server (Debian package rabbitmq-server; scripts/test installs it): {e}")
        }));
        let out = self.dir.path().join("server.out");
        wait_until("rabbitmq-server ready", Duration::from_secs(90), || {
            assert!(
                self.group.as_mut().unwrap().try_wait().unwrap().is_none(),
                "rabbitmq-server exited: {}",
                std::fs::read_to_string(&out).unwrap_or_default()
            );
            let uri = self.uri.clone();
            runtime().block_on(async move {
                match Connection::connect(&uri, ConnectionProperties::default()).await {
                    Ok(c) => {
                        let _ = c.close(200, "probe".into()).await;
                        true
                    }
                    Err(_) => false,
                }
            })
        });
    }

    /// Kills the node and its epmd at once (kill -9; its database stays).
    fn kill(&mut self) {
        if let Some(mut g) = self.group.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", g.id())])
                .status();
            let _ = g.wait();
        }
    }

    /// Starts it again on the same ports and database.
    fn restart(&mut self) {
        self.spawn();
    }

    /// (ready, unacknowledged) messages of `queue`, from `rabbitmqctl list_queues`.
    fn pending(&self, queue: &str) -> (u64, u64) {
        let mut cmd = Command::new(format!("{SBIN}/rabbitmqctl"));
        cmd.args([
            "-q",
            "-n",
            &self.node,
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ]);
        self.env(&mut cmd);
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "rabbitmqctl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                (f.len() == 3 && f[0] == queue)
                    .then(|| (f[1].parse().unwrap(), f[2].parse().unwrap()))
            })
            .next()
            .unwrap_or((u64::MAX, u64::MAX))
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// The server the tests that leave it running share: started by the first, stopped when
/// the last drops it.
fn shared_server() -> Arc<RabbitServer> {
    static SHARED: Mutex<Weak<RabbitServer>> = Mutex::new(Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = shared.upgrade() {
        return s;
    }
    let s = Arc::new(RabbitServer::start(&[]));
    *shared = Arc::downgrade(&s);
    s
}

/// The test's own client: queues, publishing with confirms, a consumer that dies.
struct Broker {
    rt: tokio::runtime::Runtime,
    conn: Connection,
    ch: Channel,
}

/// One message to publish: its `message_id` (none: no property) and payload.
struct Msg {
    id: Option<String>,
    payload: String,
}

impl Broker {
    fn connect(uri: &str) -> Broker {
        let rt = runtime();
        let (conn, ch) = rt.block_on(async {
            let conn = Connection::connect(uri, ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            (conn, ch)
        });
        Broker { rt, conn, ch }
    }

    /// Declares `queue` as dedupd does (durable; with `dead_letter_queue`, that one too).
    fn declare(&self, queue: &str, dead_letter_queue: Option<&str>) {
        self.rt.block_on(async {
            let mut args = FieldTable::default();
            if let Some(dlq) = dead_letter_queue {
                self.ch
                    .queue_declare(
                        dlq.into(),
                        QueueDeclareOptions::durable(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                args.insert(
                    "x-dead-letter-exchange".into(),
                    AMQPValue::LongString("".into()),
                );
                args.insert(
                    "x-dead-letter-routing-key".into(),
                    AMQPValue::LongString(dlq.into()),
                );
            }
            self.ch
                .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
                .await
                .unwrap();
        });
    }

    /// Publishes persistent messages to `queue` (the default exchange) with `extra`
    /// headers, and waits for every confirm.
    fn publish(&self, queue: &str, msgs: &[Msg], extra: &[(&str, &str)]) {
        self.rt.block_on(async {
            let mut confirms = Vec::new();
            for m in msgs {
                let mut headers = FieldTable::default();
                for (k, v) in extra {
                    headers.insert((*k).into(), AMQPValue::LongString((*v).into()));
                }
                let mut props = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers);
                if let Some(id) = &m.id {
                    props = props.with_message_id(id.as_str().into());
                }
                confirms.push(
                    self.ch
                        .basic_publish(
                            "".into(),
                            queue.into(),
                            BasicPublishOptions::default(),
                            m.payload.as_bytes(),
                            props,
                        )
                        .await
                        .unwrap(),
                );
            }
            for c in confirms {
                assert!(c.await.unwrap().is_ack(), "publish confirmed");
            }
        });
    }

    /// (ready messages, consumers) of `queue` (a passive declare).
    fn ready(&self, queue: &str) -> (u32, u32) {
        self.rt.block_on(async {
            let q = self
                .ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions::default().passive(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            (q.message_count(), q.consumer_count())
        })
    }

    /// Takes `n` messages on a channel of its own and closes it without acknowledging
    /// them: a consumer that died holding them. The server requeues them, `redelivered`.
    fn take_without_ack(&self, queue: &str, n: u16) {
        self.rt.block_on(async {
            let ch = self.conn.create_channel().await.unwrap();
            ch.basic_qos(n, BasicQosOptions::default()).await.unwrap();
            let mut c = ch
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            for _ in 0..n {
                c.next().await.unwrap().unwrap();
            }
            ch.close(200, "dies".into()).await.unwrap();
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
