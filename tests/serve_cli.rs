//! `dedupd serve` as a process: refuses an open bind without a token, serves over real
//! TCP (keep-alive HTTP/1.1), and exits cleanly on SIGTERM.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn dedupd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dedupd"))
}

#[test]
fn serve_refuses_a_public_bind_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let out = dedupd()
        .args(["serve", "--bind", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("http.bind") && err.contains("token"), "{err}");
}

/// One request on an open connection; returns the status line and the body.
fn request(
    conn: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (String, String) {
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut buf = vec![0u8; len];
    reader.read_exact(&mut buf).unwrap();
    (
        status.trim_end().to_string(),
        String::from_utf8_lossy(&buf).to_string(),
    )
}

#[test]
fn serve_answers_over_tcp_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, mut conn) = serve(&dir.path().join("data"));
    let (status, body) = request(&mut conn, "GET", "/healthz", "", "");
    assert!(status.ends_with("200 OK"), "{status}");
    assert!(body.contains("ok"));
    // Same connection (keep-alive): first delivery, then a replay.
    let key = "Idempotency-Key: cli-1\r\nContent-Type: application/json\r\n";
    let (status, first) = request(
        &mut conn,
        "POST",
        "/v1/subscribers/s/messages",
        key,
        "{\"a\":1}",
    );
    assert!(status.contains("201"), "{status} {first}");
    let (status, again) = request(
        &mut conn,
        "POST",
        "/v1/subscribers/s/messages",
        key,
        "{\"a\":1}",
    );
    assert!(status.contains("201"), "{status}");
    assert_eq!(first, again);
    drop(conn);

    let status = stop_with_sigterm(&mut child, "dedupd serve did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// `dedupd serve` on a free loopback port over `data`, and a connection to it.
fn serve(data: &std::path::Path) -> (std::process::Child, TcpStream) {
    let mut child = dedupd()
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let addr = address(&mut stderr);
    // Keep reading what it logs, so its stderr stays open and never fills.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let conn = TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    (child, conn)
}

/// Waits for the "HTTP API on http://ADDR" line and returns ADDR.
fn address(stderr: &mut impl BufRead) -> String {
    address_and_logs(stderr).0
}

/// The address, and the lines logged before it.
fn address_and_logs(stderr: &mut impl BufRead) -> (String, Vec<String>) {
    let mut before = Vec::new();
    loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "exited: {before:?}"
        );
        if let Some(rest) = line.split("http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().to_string();
            return (addr, before);
        }
        before.push(line);
    }
}

/// `run` and `serve` say at `info` when they start and when they are ready, and
/// `--log-format json` makes each log line one JSON object with the event's fields.
#[test]
fn serve_logs_its_lifecycle_as_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = dedupd()
        .args(["--log-format", "json", "serve", "--bind", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let (_, logs) = address_and_logs(&mut stderr);
    let _ = child.kill();
    let _ = child.wait();
    let events: Vec<serde_json::Value> = logs
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let find = |msg: &str| {
        events
            .iter()
            .find(|e| e["message"].as_str().is_some_and(|m| m.starts_with(msg)))
            .unwrap_or_else(|| panic!("no {msg:?} event in {logs:?}"))
    };
    let starting = find("starting");
    assert_eq!(starting["level"], "INFO");
    assert_eq!(starting["format"], dedupd::ledger::FORMAT_VERSION);
    let ready = find("ready");
    assert!(ready["shards"].as_u64().is_some_and(|n| n >= 1), "{ready}");
    assert!(ready["open_ms"].is_u64(), "{ready}");
}

/// On SIGTERM `serve` logs the `stopped` line the operations guide lists.
#[test]
fn serve_logs_stopped_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = dedupd()
        .args(["--log-format", "json", "serve", "--bind", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    address_and_logs(&mut stderr);
    let status = stop_with_sigterm(&mut child, "dedupd serve did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(
        rest.lines().any(|l| l.contains("\"message\":\"stopped")),
        "no stopped line in: {rest}"
    );
}

#[test]
fn run_with_http_serves_stdin_and_http_over_one_ledger() {
    let dir = tempfile::tempdir().unwrap();
    // A message over stdin...
    let (mut child, addr, stdin) = run_and_process_one(
        dir.path(),
        "[http]\nbind = \"127.0.0.1:0\"\n",
        &[],
        "shared-1",
    );
    // ...is a duplicate over HTTP: one ledger, one claim.
    let mut conn = TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let key = "Idempotency-Key: shared-1\r\nContent-Type: application/json\r\n";
    let (status, _) = request(
        &mut conn,
        "POST",
        "/v1/subscribers/s/messages",
        key,
        "{\"a\":1}",
    );
    assert!(status.contains("201"), "{status}");
    let (_, stats) = request(&mut conn, "GET", "/v1/subscribers/s/stats", "", "");
    assert!(
        stats.contains("\"processed\":1") && stats.contains("\"duplicates\":1"),
        "{stats}"
    );
    // stdin ends; the server keeps serving until SIGTERM.
    drop(stdin);
    let (status, _) = request(&mut conn, "GET", "/healthz", "", "");
    assert!(status.ends_with("200 OK"), "{status}");
    drop(conn);
    let status = stop_with_sigterm(&mut child, "dedupd run did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// SIGTERM while stdin is still open: the stdin reader still holds the ledger, but the
/// exit closes it all the same, so `inspect` (which refuses a directory not closed
/// cleanly) reads it at once.
#[test]
fn sigterm_with_stdin_open_leaves_a_clean_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, _addr, stdin) = run_and_process_one(
        dir.path(),
        "[http]\nbind = \"127.0.0.1:0\"\n",
        &[],
        "open-1",
    );
    let status = stop_with_sigterm(&mut child, "dedupd run did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
    drop(stdin);
    let report = inspect(&dir.path().join("data"), &[]);
    assert!(
        report.status.success(),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
}

fn inspect(data: &std::path::Path, extra: &[&str]) -> std::process::Output {
    dedupd()
        .args(["inspect", "--json", "--data-dir"])
        .arg(data)
        .args(extra)
        .output()
        .unwrap()
}

/// `inspect` never writes: next to a running engine it says where the same counts are
/// (before, it failed with the generic "in use" error), after a kill -9 it asks for
/// `--repair` instead of repairing on its own, and `--repair` opens the files for writing.
#[test]
fn inspect_points_at_the_running_engine_and_repairs_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut child, mut conn) = serve(&data);
    for i in 0..3 {
        let key = format!("Idempotency-Key: k-{i}\r\nContent-Type: application/json\r\n");
        let (status, body) = request(&mut conn, "POST", "/v1/subscribers/s/messages", &key, "{}");
        assert!(status.contains("201"), "{status} {body}");
    }

    let running = inspect(&data, &[]);
    assert!(!running.status.success());
    let err = String::from_utf8_lossy(&running.stderr);
    assert!(
        err.contains("in use by a running dedupd") && err.contains("/v1/subscribers"),
        "{err}"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = inspect(&data, &[]);
    assert!(!killed.status.success());
    let err = String::from_utf8_lossy(&killed.stderr);
    assert!(
        err.contains("not closed cleanly") && err.contains("--repair"),
        "{err}"
    );

    let claims = |out: &std::process::Output| -> u64 {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["subscribers"][0]["claims"].as_u64().unwrap()
    };
    assert_eq!(claims(&inspect(&data, &["--repair"])), 3);
    // Repaired and closed cleanly: the read-only look works and agrees.
    let after = inspect(&data, &[]);
    assert_eq!(claims(&after), 3);
}

/// `inspect --repair` after a kill -9 says on stderr what the open does, which can take
/// long (before, nothing until the report): on a stderr that is not a terminal, whole
/// lines for the start, the redb repair of a file not closed cleanly and each shard
/// opened. stdout carries the report alone, so `--json` still parses as one document.
#[test]
fn inspect_repair_prints_progress_lines_on_stderr_only() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut child, mut conn) = serve(&data);
    let key = "Idempotency-Key: k-1\r\nContent-Type: application/json\r\n";
    let (status, body) = request(&mut conn, "POST", "/v1/subscribers/s/messages", key, "{}");
    assert!(status.contains("201"), "{status} {body}");
    child.kill().unwrap();
    child.wait().unwrap();

    // `output()` pipes stderr: not a terminal, so plain lines rather than a bar.
    let out = inspect(&data, &["--repair"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let shards: usize = err
        .lines()
        .find_map(|l| l.strip_prefix("repair: opening "))
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no start line on stderr: {err:?}"))
        .parse()
        .unwrap();
    assert!(shards >= 1, "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("repair: shard ") && l.contains("not closed cleanly")),
        "the repair of a killed engine's file is said: {err}"
    );
    for shard in 0..shards {
        let open = format!("repair: shard {shard} open (");
        assert!(err.lines().any(|l| l.starts_with(&open)), "{open} in {err}");
    }
    assert!(
        err.lines()
            .any(|l| l.starts_with(&format!("repair: {shards} shards open in "))),
        "{err}"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(!stdout.contains("repair:"), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["subscribers"][0]["claims"], 1, "{stdout}");
}

/// `run --metrics-bind` without an `[http]` section serves `/metrics`, `/healthz` and
/// `/readyz` and nothing else, over the ledger the stdin pipe writes to.
#[test]
fn run_serves_metrics_alone_on_its_own_listener() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr, stdin) = run_and_process_one(
        dir.path(),
        "[ledger]\nshards = 2\n",
        &["--metrics-bind", "127.0.0.1:0"],
        "m-1",
    );
    let addr = addr.trim_end_matches("/metrics").to_string();
    let mut conn = TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (status, metrics) = request(&mut conn, "GET", "/metrics", "", "");
    assert!(status.ends_with("200 OK"), "{status}");
    assert!(
        metrics.contains("dedupd_messages_processed_total{subscriber=\"s\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("# HELP dedupd_ready "), "{metrics}");
    let (status, _) = request(&mut conn, "GET", "/readyz", "", "");
    assert!(status.ends_with("200 OK"), "{status}");
    // Nothing but metrics and health here.
    for path in ["/v1/subscribers", "/", "/openapi.json"] {
        let (status, _) = request(&mut conn, "GET", path, "", "");
        assert!(status.contains("404"), "{path}: {status}");
    }
    drop(conn);
    drop(stdin);
    let status = exit_within_30s(&mut child, "run did not end with stdin");
    assert!(status.success(), "{status:?}");
}

/// Waits up to 30 s for `child` to exit; panics with `what` if it does not.
/// Sends SIGTERM to `child` and waits (at most 30 s, else fails with `what`) for it to exit.
fn stop_with_sigterm(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    exit_within_30s(child, what)
}

fn exit_within_30s(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `dedupd run` with `config` (and `args`) over a data directory in `dir`, its address
/// (the first `http://` line it logs), and stdin after one message `id` of subscriber `s`
/// came out `processed` on stdout. Its stderr and stdout are drained in the background.
fn run_and_process_one(
    dir: &std::path::Path,
    config: &str,
    args: &[&str],
    id: &str,
) -> (std::process::Child, String, std::process::ChildStdin) {
    let path = dir.join("dedupd.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = dedupd()
        .arg("run")
        .args(args)
        .arg("--config")
        .arg(&path)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let addr = address(&mut stderr);
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let mut stdin = child.stdin.take().unwrap();
    writeln!(
        stdin,
        r#"{{"subscriber":"s","id":"{id}","payload":{{"a":1}}}}"#
    )
    .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut outcome = String::new();
    stdout.read_line(&mut outcome).unwrap();
    assert!(outcome.contains("\"processed\""), "{outcome}");
    // Later output must not meet a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    (child, addr, stdin)
}

/// Text logs written to a file, a pipe or journald carry no colour codes (a terminal gets
/// them unless `NO_COLOR` is set).
#[test]
fn text_logs_into_a_pipe_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = dedupd()
        .args(["serve", "--bind", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let (_, before) = address_and_logs(&mut stderr);
    let status = stop_with_sigterm(&mut child, "dedupd serve did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    let all = before.concat() + &rest;
    assert!(all.contains("INFO"), "no info lines: {all}");
    assert!(!all.contains('\u{1b}'), "colour codes in: {all:?}");
}

/// Under systemd's `Type=notify` (packaging/systemd/dedupd.service) the start counts as
/// done when dedupd says `READY=1` on `NOTIFY_SOCKET`: after the API is bound, not at
/// exec; a stop says `STOPPING=1` first.
#[test]
fn serve_tells_the_service_manager_when_it_is_ready_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut child = dedupd()
        .args(["serve", "--bind", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("NOTIFY_SOCKET", &socket_path)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let addr = address(&mut stderr);
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .expect("a notification before the timeout");
    let ready = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    // Ready means the API answers.
    TcpStream::connect(&addr).unwrap();
    let status = stop_with_sigterm(&mut child, "dedupd serve did not stop on SIGTERM");
    assert!(status.success(), "{status:?}");
    let n = socket.recv(&mut buf).expect("a notification on stop");
    let stopping = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
}
