//! Effectively-once over HTTP ingest under `kill -9`: `dedupd serve` runs the
//! `fixture-counter` component (`count/<order>` = get + 1 per event, not idempotent) with a
//! tiny state buffer; four clients post a stream of events with `Idempotency-Key`s and are
//! cut off by ten seeded kills; after each restart they retry every request they have no
//! answer for, with the same key, as an HTTP client following the Idempotency-Key draft
//! would. Afterwards every event has its `201`, no event was answered as newly processed
//! twice, and every order's count is exactly 2 (two distinct events per order).

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const EVENTS: usize = 1_200;
const CLIENTS: usize = 4;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One request on an open connection: status, whether it was a replay, body. Any I/O
/// error (the server was killed) is returned, not a panic.
fn post(conn: &mut TcpStream, key: &str, body: &str) -> std::io::Result<(u16, bool, String)> {
    write!(
        conn,
        "POST /v1/subscribers/default/messages HTTP/1.1\r\nHost: localhost\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut status = String::new();
    if reader.read_line(&mut status)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status:?}")))?;
    let (mut len, mut replayed) = (0usize, false);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            len = v.trim().parse().map_err(std::io::Error::other)?;
        }
        replayed |= l.starts_with("idempotent-replayed: true");
    }
    let mut buf = vec![0u8; len];
    reader.read_exact(&mut buf)?;
    Ok((code, replayed, String::from_utf8_lossy(&buf).into_owned()))
}

fn start(data: &Path, config: &Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .arg("--config")
        .arg(config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "serve exited");
        if let Some(a) = line.split("http://").nth(1) {
            break a.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    (child, addr)
}

/// What the clients learned: per event, the answers that said "processed" (not replayed)
/// and whether it has its `201`.
#[derive(Default)]
struct Ledgerish {
    fresh: BTreeMap<usize, usize>,
    answered: BTreeSet<usize>,
    /// Requests cut off by a kill (retried after the restart), and replayed answers.
    cut: usize,
    replays: usize,
}

/// One round: a server, `CLIENTS` clients taking unanswered events from `pending` until it
/// is empty or, with `kill_after`, that many answers arrived this round (then kill -9).
fn round(
    data: &Path,
    config: &Path,
    pending: &Arc<Mutex<Vec<usize>>>,
    seen: &Arc<Mutex<Ledgerish>>,
    kill_after: Option<usize>,
) {
    let (mut child, addr) = start(data, config);
    let answers = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (pending, seen, answers, addr) =
                (pending.clone(), seen.clone(), answers.clone(), addr.clone());
            std::thread::spawn(move || {
                let Ok(mut conn) = TcpStream::connect(&addr) else {
                    return;
                };
                conn.set_read_timeout(Some(Duration::from_secs(30)))
                    .unwrap();
                loop {
                    let Some(i) = pending.lock().unwrap().pop() else {
                        return;
                    };
                    let body = format!(
                        "{{\"type\":\"OrderPlaced\",\"order_id\":\"o-{}\",\"n\":{i}}}",
                        i / 2
                    );
                    match post(&mut conn, &format!("e-{i}"), &body) {
                        Ok((201, replayed, text)) => {
                            assert!(text.contains("\"processed\""), "e-{i}: {text}");
                            let mut s = seen.lock().unwrap();
                            s.answered.insert(i);
                            match replayed {
                                false => *s.fresh.entry(i).or_default() += 1,
                                true => s.replays += 1,
                            }
                            answers.fetch_add(1, Ordering::SeqCst);
                        }
                        // In flight on another connection of a killed server's last
                        // moments, or busy: ask again later.
                        Ok((409 | 503, _, _)) => pending.lock().unwrap().insert(0, i),
                        Ok((code, _, text)) => panic!("e-{i}: {code} {text}"),
                        Err(_) => {
                            // Killed mid-request: no answer, so retry it after the restart.
                            pending.lock().unwrap().push(i);
                            seen.lock().unwrap().cut += 1;
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    if let Some(k) = kill_after {
        let deadline = Instant::now() + Duration::from_secs(120);
        while answers.load(Ordering::SeqCst) < k {
            assert!(Instant::now() < deadline, "round stalled");
            std::thread::sleep(Duration::from_millis(1));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        for c in clients {
            c.join().unwrap();
        }
    } else {
        for c in clients {
            c.join().unwrap();
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[test]
fn counts_are_exact_after_ten_kill_9_rounds_over_http_with_client_retries() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = dir.path().join("dedupd.toml");
    std::fs::write(
        &config,
        format!(
            "[ledger]\nstate_buffer_entries = 64\n[defaults]\nhandler = {:?}\nhandler_cpu_budget = \"2s\"\npartition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\n",
            common::component("fixture_counter").display().to_string()
        ),
    )
    .unwrap();
    let seed = common::seed(0x4774_9ca5);
    eprintln!("seed {seed:#x} (DEDUPD_RELIABILITY_SEED varies it)");
    // Events in a seeded order, popped from the end.
    let mut order: Vec<usize> = (0..EVENTS).collect();
    order.sort_by_key(|i| mix(seed ^ *i as u64));
    let pending = Arc::new(Mutex::new(order));
    let seen = Arc::new(Mutex::new(Ledgerish::default()));
    for r in 0..10u64 {
        let kill_after = 30 + (mix(seed ^ 0xc0 ^ r) % 60) as usize;
        round(&data, &config, &pending, &seen, Some(kill_after));
    }
    round(&data, &config, &pending, &seen, None);

    let seen = seen.lock().unwrap();
    eprintln!(
        "{EVENTS} events, 10 kills: {} requests cut off and retried, {} answers replayed",
        seen.cut, seen.replays
    );
    assert!(
        seen.cut > 0,
        "no kill cut a request off: the loop tested nothing"
    );
    assert_eq!(seen.answered.len(), EVENTS, "events never answered 201");
    let twice: Vec<_> = seen.fresh.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(
        twice.is_empty(),
        "answered as newly processed twice: {twice:?}"
    );

    let counts: BTreeMap<String, String> = common::state_dump(&data, &config)
        .iter()
        .map(|l| {
            (
                l["key"].as_str().unwrap().to_string(),
                l["value"].to_string(),
            )
        })
        .collect();
    assert_eq!(counts.len(), EVENTS / 2, "orders lost or split");
    let wrong: Vec<_> = counts.iter().filter(|(_, v)| *v != "2").take(5).collect();
    assert!(wrong.is_empty(), "counts doubled or lost: {wrong:?}");
}
