//! The mosquitto broker and the client `tests/mqtt.rs` uses: a `mosquitto` of the test's
//! own on a free loopback port with persistence in a temporary directory (restartable on
//! the same port and store), a publisher over MQTT 5, and the persistent sessions seen the
//! way the broker sees them.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::PublishProperties;

use crate::common::broker::{current_thread_runtime, free_port, wait_until};
use crate::common::tls::Pki;

/// A `mosquitto` of the test's own, killed when dropped.
pub struct Mosquitto {
    child: Child,
    pub port: u16,
    pub url: String,
    dir: tempfile::TempDir,
    /// A second listener, with TLS: its port and its lines of mosquitto.conf.
    tls: Option<(u16, String)>,
}

fn spawn_broker(port: u16, dir: &Path, tls: Option<&(u16, String)>) -> Child {
    let conf = dir.join("mosquitto.conf");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    // `user root`: as root, mosquitto would switch to its own user, which cannot write
    // the temporary store (ignored when not run as root).
    std::fs::write(
        &conf,
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\n\
             max_inflight_messages 100\nmax_queued_messages 0\nuser root\nlog_dest file {}\n{}",
            store.display(),
            dir.join("mosquitto.log").display(),
            tls.map_or("", |(_, lines)| lines.as_str())
        ),
    )
    .unwrap();
    let child = Command::new("mosquitto")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start mosquitto (Debian package mosquitto; scripts/test installs it): {e}"
            )
        });
    let ports = [Some(port), tls.map(|(p, _)| *p)];
    wait_until("mosquitto listening", Duration::from_secs(20), || {
        ports
            .iter()
            .flatten()
            .all(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_ok())
    });
    child
}

impl Mosquitto {
    pub fn start() -> Mosquitto {
        Mosquitto::start_with(None)
    }

    fn start_with(tls: Option<(u16, String)>) -> Mosquitto {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        Mosquitto {
            child: spawn_broker(port, dir.path(), tls.as_ref()),
            port,
            url: format!("mqtt://127.0.0.1:{port}"),
            dir,
            tls,
        }
    }

    /// [`Mosquitto::start`] with a second listener, `mqtts` on a port of its own (the
    /// plain one stays for the test's publisher and session checks): its certificate is
    /// signed by the test CA for `localhost` and `127.0.0.1`, and it requires a client
    /// certificate signed by the same CA (mutual TLS). Returns the broker and the port.
    pub fn start_tls(pki: &Pki) -> (Mosquitto, u16) {
        let tls_port = free_port();
        let lines = format!(
            "listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n\
             require_certificate true\n",
            pki.ca.display(),
            pki.server_cert.display(),
            pki.server_key.display()
        );
        (Mosquitto::start_with(Some((tls_port, lines))), tls_port)
    }

    /// The broker's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }

    /// Stops the broker with SIGTERM: it writes its store (sessions, queued and
    /// unacknowledged messages) and exits.
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.child = spawn_broker(self.port, self.dir.path(), self.tls.as_ref());
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One message to publish: topic, payload, MQTT 5 user properties.
pub struct Msg {
    pub topic: String,
    pub payload: String,
    pub props: Vec<(String, String)>,
}

fn mqtt5_options(port: u16, id: &str, clean: bool) -> rumqttc::v5::MqttOptions {
    let mut o = rumqttc::v5::MqttOptions::new(id, "127.0.0.1", port);
    o.set_clean_start(clean)
        .set_session_expiry_interval(Some(3600))
        .set_manual_acks(true);
    o
}

/// Publishes at QoS 1 over MQTT 5 and waits for every PUBACK.
pub fn publish(port: u16, msgs: &[Msg]) {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event};
    current_thread_runtime().block_on(async {
        let (client, mut events) =
            AsyncClient::new(mqtt5_options(port, "test-publisher", true), 1024);
        let publisher = client.clone();
        let sends: Vec<_> = msgs
            .iter()
            .map(|m| {
                let props = PublishProperties {
                    user_properties: m.props.clone(),
                    ..Default::default()
                };
                (m.topic.clone(), m.payload.clone(), props)
            })
            .collect();
        let n = sends.len();
        let send = tokio::spawn(async move {
            for (topic, payload, props) in sends {
                publisher
                    .publish_with_properties(
                        topic,
                        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                        false,
                        payload,
                        props,
                    )
                    .await
                    .unwrap();
            }
        });
        let mut acked = 0;
        while acked < n {
            match events.poll().await {
                Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                Ok(_) => {}
                Err(e) => panic!("publisher: {e}"),
            }
        }
        send.await.unwrap();
        client.disconnect().await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(1), events.poll()).await;
    });
}

/// Connects as `id` with a persistent session and subscribes `filter` at QoS 1, then
/// disconnects: from now on the broker queues matching messages for the session.
pub fn create_session(port: u16, id: &str, filter: &str) {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event};
    current_thread_runtime().block_on(async {
        let (client, mut events) = AsyncClient::new(mqtt5_options(port, id, false), 16);
        client
            .subscribe(filter, rumqttc::v5::mqttbytes::QoS::AtLeastOnce)
            .await
            .unwrap();
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => break,
                Ok(_) => {}
                Err(e) => panic!("session: {e}"),
            }
        }
        client.disconnect().await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(1), events.poll()).await;
    });
}

/// Takes over the persistent session `id` for `wait` and counts what the broker sends
/// it (acknowledging nothing): every message it still holds for the session, whether
/// queued or delivered and unacknowledged.
pub fn left_in_session(port: u16, id: &str, wait: Duration) -> usize {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event};
    current_thread_runtime().block_on(async {
        let (client, mut events) = AsyncClient::new(mqtt5_options(port, id, false), 16);
        let mut got = 0;
        let deadline = tokio::time::Instant::now() + wait;
        while let Ok(ev) = tokio::time::timeout_at(deadline, events.poll()).await {
            match ev {
                Ok(Event::Incoming(Packet::Publish(_))) => got += 1,
                Ok(_) => {}
                Err(e) => panic!("session check: {e}"),
            }
        }
        drop(client);
        got
    })
}
