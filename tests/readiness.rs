//! `/readyz` with a Kafka source, as an operator's probe sees it: 503 naming the source and
//! the reason once no broker has been reachable for the grace period (10 s), 200 while a
//! broker answers; and an absent broker is a few log lines, not librdkafka's hundreds.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Running {
    child: Child,
    addr: String,
    lines: Arc<Mutex<Vec<String>>>,
    started: Instant,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `dedupd run` with one Kafka subscription of `topic` on `brokers` and the API on a free
/// loopback port; its log lines are collected.
fn run(dir: &Path, brokers: &str, topic: &str) -> Running {
    let config = dir.join("dedupd.toml");
    std::fs::write(
        &config,
        format!(
            "[[subscriber]]\nname = \"orders\"\nkey = {{ source = \"header\", name = \"message-id\" }}\n\n[http]\nbind = \"127.0.0.1:0\"\n\n\
             [kafka]\nbrokers = \"{brokers}\"\ngroup = \"readiness\"\n\n\
             [[kafka.subscription]]\nsubscriber = \"orders\"\ntopics = [\"{topic}\"]\n"
        ),
    )
    .unwrap();
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["run", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let lines = Arc::new(Mutex::new(Vec::new()));
    let addr = loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "exited: {:?}",
            lines.lock().unwrap()
        );
        let found = line
            .split("http://")
            .nth(1)
            .map(|rest| rest.split_whitespace().next().unwrap().to_string());
        lines.lock().unwrap().push(line);
        if let Some(addr) = found {
            break addr;
        }
    };
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in stderr.lines() {
            let Ok(line) = line else { break };
            sink.lock().unwrap().push(line);
        }
    });
    Running {
        child,
        addr,
        lines,
        started,
    }
}

/// Status and body of `GET /readyz`.
fn readyz(addr: &str) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!("GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    let status = text.split(' ').nth(1).unwrap().parse().unwrap();
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (status, body)
}

#[test]
fn readyz_fails_naming_kafka_when_no_broker_answers_and_logs_stay_few() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on port 1.
    let r = run(dir.path(), "127.0.0.1:1", "orders");
    let (status, body) = readyz(&r.addr);
    assert_eq!(status, 200, "within the grace period: {body}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        let (status, body) = readyz(&r.addr);
        if status == 503 {
            break body;
        }
        assert!(Instant::now() < deadline, "still {status}: {body}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        r.started.elapsed() >= Duration::from_secs(10),
        "503 before the grace period"
    );
    assert!(body.contains("kafka subscriber orders"), "{body}");
    assert!(body.contains("no Kafka broker"), "{body}");
    // Over 15 s of refused connections (librdkafka retries every 100 ms to 10 s), the
    // log holds a bounded number of librdkafka lines.
    while r.started.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let lines = r.lines.lock().unwrap();
    let rdkafka = lines.iter().filter(|l| l.contains("librdkafka")).count();
    assert!(
        (1..=12).contains(&rdkafka),
        "{rdkafka} librdkafka lines in 15 s:\n{}",
        lines.join("\n")
    );
}

#[test]
fn readyz_is_ready_while_a_broker_answers() {
    let mut broker = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["dev-broker", "--topic", "orders:2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut bootstrap = String::new();
    BufReader::new(broker.stdout.take().unwrap())
        .read_line(&mut bootstrap)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let r = run(dir.path(), bootstrap.trim(), "orders");
    // Past the grace period, the broker's answers are what keeps it ready.
    while r.started.elapsed() < Duration::from_secs(16) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, body) = readyz(&r.addr);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ready\""), "{body}");
    drop(r);
    let _ = broker.kill();
    let _ = broker.wait();
}
