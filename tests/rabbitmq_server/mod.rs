//! The RabbitMQ nodes and the client `tests/rabbitmq.rs` uses: a `rabbitmq-server` of the
//! tests' own on free loopback ports (own epmd, cookie, database, logs; no plugins unless
//! a test names some), one shared by the tests that leave it alone, and a
//! publisher/inspector over lapin.

use std::process::{Child, Command};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::common::broker::{free_port, wait_until};

/// Where Debian's package puts the scripts (`/usr/sbin/rabbitmq-server` runs them as the
/// `rabbitmq` user; the tests run them as they are, with their own directories).
pub const SBIN: &str = "/usr/lib/rabbitmq/bin";

/// A `rabbitmq-server` node of the tests' own: its epmd, ports, cookie and directories.
pub struct RabbitServer {
    /// The process group (`sh` leading epmd, the server and a watcher of this process).
    group: Option<Child>,
    port: u16,
    epmd_port: u16,
    dist_port: u16,
    node: String,
    /// The plugins it runs (comma-separated names; empty: none).
    plugins: String,
    dir: tempfile::TempDir,
    pub uri: String,
}

impl RabbitServer {
    /// Starts a node; `rabbit_env` is added to the `rabbit` application's settings
    /// (advanced.config), e.g. `{consumer_timeout, 1000}`.
    pub fn start(rabbit_env: &[&str]) -> RabbitServer {
        RabbitServer::start_conf(rabbit_env, "")
    }

    /// [`RabbitServer::start`], with `conf` added to rabbitmq.conf (a TLS listener).
    pub fn start_conf(rabbit_env: &[&str], conf: &str) -> RabbitServer {
        RabbitServer::start_with(rabbit_env, conf, &[])
    }

    /// A node that runs the `plugins` shipped with the server (e.g.
    /// `rabbitmq_consistent_hash_exchange`), enabled from its start.
    pub fn start_plugins(plugins: &[&str]) -> RabbitServer {
        RabbitServer::start_with(&[], "", plugins)
    }

    fn start_with(rabbit_env: &[&str], conf: &str, plugins: &[&str]) -> RabbitServer {
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
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{conf}"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("advanced.config"),
            format!("[{{rabbit, [{}]}}].\n", rabbit_env.join(", ")),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("enabled_plugins"),
            format!("[{}].\n", plugins.join(",")),
        )
        .unwrap();
        let mut server = RabbitServer {
            group: None,
            port,
            epmd_port: free_port(),
            dist_port: free_port(),
            node: format!("dedupd-test-{}-{n}@localhost", std::process::id()),
            plugins: plugins.join(","),
            uri: format!("amqp://127.0.0.1:{port}/%2f"),
            dir,
        };
        server.spawn();
        server
    }

    pub fn env(&self, cmd: &mut Command) {
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
            .env("RABBITMQ_ENABLED_PLUGINS", &self.plugins);
    }

    /// Starts the group and waits until the server takes connections.
    pub fn spawn(&mut self) {
        let script = format!(
            "epmd -port {epmd} & \
             until epmd -port {epmd} -names >/dev/null 2>&1; do sleep 0.1; done; \
             {SBIN}/rabbitmq-server & \
             while kill -0 {parent} 2>/dev/null; do sleep 1; done; kill -KILL 0",
            epmd = self.epmd_port,
            parent = std::process::id()
        );
        // One node boots at a time: two Erlang VMs starting together beside the rest of
        // the suite on two cores took past the wait (seen once in a full run).
        static BOOTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _booting = BOOTING.lock().unwrap_or_else(|p| p.into_inner());
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
        wait_until("rabbitmq-server ready", Duration::from_secs(240), || {
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
    pub fn kill(&mut self) {
        if let Some(mut g) = self.group.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", g.id())])
                .status();
            let _ = g.wait();
        }
    }

    /// Starts it again on the same ports and database.
    pub fn restart(&mut self) {
        self.spawn();
    }

    /// `rabbitmqctl -q -n NODE ARGS`: its output as rows of tab-separated fields; asserts
    /// that it succeeded.
    fn ctl_rows(&self, args: &[&str]) -> Vec<Vec<String>> {
        let mut cmd = Command::new(format!("{SBIN}/rabbitmqctl"));
        cmd.args(["-q", "-n", &self.node]).args(args);
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
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect()
    }

    /// `rabbitmqctl list_connections COLUMNS`: one row of fields per connection.
    pub fn connections(&self, columns: &[&str]) -> Vec<Vec<String>> {
        let mut args = vec!["list_connections"];
        args.extend_from_slice(columns);
        self.ctl_rows(&args)
            .into_iter()
            .filter(|f| f.len() == columns.len())
            .collect()
    }

    /// (ready, unacknowledged) messages of `queue`, from `rabbitmqctl list_queues`.
    pub fn pending(&self, queue: &str) -> (u64, u64) {
        self.ctl_rows(&[
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .into_iter()
        .find_map(|f| {
            (f.len() == 3 && f[0] == queue).then(|| (f[1].parse().unwrap(), f[2].parse().unwrap()))
        })
        .unwrap_or((u64::MAX, u64::MAX))
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// The server the tests that leave it running share: started by the first, stopped when
/// the last drops it.
pub fn shared_server() -> Arc<RabbitServer> {
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
pub struct Broker {
    rt: tokio::runtime::Runtime,
    conn: Connection,
    ch: Channel,
}

/// One message to publish: its `message_id` (none: no property) and payload.
pub struct Msg {
    pub id: Option<String>,
    pub payload: String,
}

/// One message taken from a queue: its `message_id`, its `dedupd-key` header and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Got {
    pub id: Option<String>,
    pub key: Option<String>,
    pub payload: String,
}

impl Broker {
    pub fn connect(uri: &str) -> Broker {
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
    pub fn declare(&self, queue: &str, dead_letter_queue: Option<&str>) {
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

    /// A durable consistent-hash exchange (plugin `rabbitmq_consistent_hash_exchange`)
    /// that hashes the `message_id` property, and `queues` declared as dedupd does, each
    /// bound to it with the weight 1 (the binding's routing key): every message with the
    /// same `message_id` goes to the same queue.
    pub fn consistent_hash(&self, exchange: &str, queues: &[&str]) {
        self.rt.block_on(async {
            let mut args = FieldTable::default();
            args.insert(
                "hash-property".into(),
                AMQPValue::LongString("message_id".into()),
            );
            self.ch
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Custom("x-consistent-hash".into()),
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await
                .unwrap();
        });
        for q in queues {
            self.declare(q, None);
            self.rt.block_on(async {
                self.ch
                    .queue_bind(
                        (*q).into(),
                        exchange.into(),
                        "1".into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
            });
        }
    }

    /// A durable direct exchange and `queue` (declared as dedupd does) bound to it with
    /// `routing_key`; without `routing_key` only the exchange.
    pub fn direct(&self, exchange: &str, queue: &str, routing_key: Option<&str>) {
        self.rt.block_on(async {
            self.ch
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
        });
        self.declare(queue, None);
        if let Some(key) = routing_key {
            self.rt.block_on(async {
                self.ch
                    .queue_bind(
                        queue.into(),
                        exchange.into(),
                        key.into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
            });
        }
    }

    /// Takes every ready message of `queue` (`basic.get`, acknowledged).
    pub fn drain(&self, queue: &str) -> Vec<Got> {
        self.rt.block_on(async {
            let mut out = Vec::new();
            while let Some(m) = self
                .ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                let p = &m.delivery.properties;
                let key = p
                    .headers()
                    .as_ref()
                    .and_then(|h| match h.inner().get("dedupd-key") {
                        Some(AMQPValue::LongString(s)) => {
                            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                        }
                        _ => None,
                    });
                out.push(Got {
                    id: p.message_id().as_ref().map(|s| s.as_str().to_string()),
                    key,
                    payload: String::from_utf8_lossy(&m.delivery.data).into_owned(),
                });
            }
            out
        })
    }

    /// Publishes persistent messages to `queue` (the default exchange) with `extra`
    /// headers, and waits for every confirm.
    pub fn publish(&self, queue: &str, msgs: &[Msg], extra: &[(&str, &str)]) {
        self.publish_to("", queue, msgs, extra);
    }

    /// Publishes persistent messages to `exchange` with `routing_key` and `extra` headers,
    /// and waits for every confirm (`mandatory`: a message no queue took fails the test).
    pub fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        msgs: &[Msg],
        extra: &[(&str, &str)],
    ) {
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
                            exchange.into(),
                            routing_key.into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            m.payload.as_bytes(),
                            props,
                        )
                        .await
                        .unwrap(),
                );
            }
            for c in confirms {
                let confirm = c.await.unwrap();
                assert!(confirm.is_ack(), "publish confirmed");
                assert!(
                    confirm.take_message().is_none(),
                    "a message no queue took came back"
                );
            }
        });
    }

    /// (ready messages, consumers) of `queue` (a passive declare).
    pub fn ready(&self, queue: &str) -> (u32, u32) {
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
    pub fn take_without_ack(&self, queue: &str, n: u16) {
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
