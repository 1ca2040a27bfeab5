//! The dashboard in a real headless browser: the engine's server runs on a loopback port,
//! Chromium loads `/` (no network access beyond it) and dumps the DOM after the page's
//! scripts rendered; the test checks what an operator would see. Chromium comes from the
//! Debian `chromium` package (`.ci/run` installs it); without it this test fails.
//!
//! The tests that click drive Chromium through the DevTools protocol over
//! `--remote-debugging-pipe` (NUL-separated JSON on the browser's fds 3 and 4, wired
//! by `sh`), so no websocket client is needed and the product page has no test hooks.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use dedupd::admin::{serve, AdminState};
use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::envelope::{fingerprint, key_hash};
use dedupd::ledger::{Job, Ledger, Outcome, RecordKind};
use serde_json::{json, Value};

fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(path) = std::env::var("PATH") {
            for dir in std::env::split_paths(&path) {
                let p = dir.join(name);
                if p.is_file() {
                    return p;
                }
            }
        }
    }
    panic!("chromium is not installed: `apt-get install -y chromium` (.ci/run does); the dashboard test needs a real headless browser");
}

const BROWSER_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
];

/// Runs Chromium headless on `url` and returns the DOM after the scripts ran.
fn dump_dom(url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(chromium())
        .args(BROWSER_FLAGS)
        .args([
            &format!("--user-data-dir={}", profile.path().display()),
            "--virtual-time-budget=5000",
            "--dump-dom",
            url,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "chromium failed: {:?}", out.status);
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn submit(ledger: &Ledger, sub: &str, id: &str, payload: &str) -> Outcome {
    let s = ledger.subscriber(sub).unwrap();
    let (ack, rx) = crossbeam_channel::unbounded();
    let key = key_hash(id.as_bytes());
    let job = Job::new(
        0,
        s.id,
        key,
        fingerprint(payload.as_bytes()),
        id,
        payload.as_bytes(),
        ack,
    );
    ledger.submit(ledger.route(key), vec![job]).unwrap();
    rx.recv().unwrap()[0].outcome.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_subscribers_counts_and_dead_letters_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse("[ledger]\nshards = 2\n").unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    for (id, payload) in [("o-1", "{}"), ("o-2", "{}"), ("o-3", "{}"), ("o-1", "{}")] {
        submit(&ledger, "orders-dash", id, payload);
    }
    assert_eq!(
        submit(&ledger, "orders-dash", "o-2", r#"{"x":1}"#).name(),
        "quarantined"
    );
    submit(&ledger, "billing-dash", "b-1", "{}");
    let dead = ledger
        .add_dead_letter(
            "orders-dash",
            json!({"reason": "malformed JSON at line 1", "payload": "{not json"}),
        )
        .unwrap();
    let state = AdminState::new(ledger.clone(), &config, None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, state, async move {
        let _ = stopped.await;
    }));

    let url = format!("http://{addr}/");
    let dom = tokio::task::spawn_blocking(move || dump_dom(&url))
        .await
        .unwrap();

    let _ = stop.send(());
    server.await.unwrap().unwrap();
    assert!(dom.contains("<h1>dedupd</h1>"), "no page: {dom}");
    assert!(
        dom.contains("status ok"),
        "the page could not reach the API: {dom}"
    );
    for needle in [
        "<td>orders-dash</td>",
        "<td>billing-dash</td>",
        // orders-dash: 3 processed, 1 duplicate, 1 quarantined.
        "<td>3</td><td>1</td><td>20.0 %</td><td>1</td>",
        &format!("<td>{dead}</td>"),
        "malformed JSON at line 1",
        "<td>o-2</td>",
    ] {
        assert!(
            dom.contains(needle),
            "the dashboard does not show {needle:?}:\n{dom}"
        );
    }
}

/// A headless Chromium driven over the DevTools protocol, with one page attached.
struct Browser {
    child: Child,
    commands: ChildStdin,
    events: mpsc::Receiver<Value>,
    next_id: u64,
    session: String,
    /// The messages of the JavaScript dialogs (`confirm`) the page opened; each was
    /// accepted.
    dialogs: Vec<String>,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium and opens `url` in a new page.
    fn open(url: &str) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        // The protocol runs on the browser's fds 3 (commands in) and 4 (replies out).
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(r#"exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null"#)
            .arg(chromium())
            .args(BROWSER_FLAGS)
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("--remote-debugging-pipe")
            .arg("about:blank")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let commands = child.stdin.take().unwrap();
        let replies = child.stdout.take().unwrap();
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(replies);
            loop {
                let mut msg = Vec::new();
                match r.read_until(0, &mut msg) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        msg.pop_if(|b| *b == 0);
                        let Ok(v) = serde_json::from_slice::<Value>(&msg) else {
                            continue;
                        };
                        if tx.send(v).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let mut b = Browser {
            child,
            commands,
            events,
            next_id: 0,
            session: String::new(),
            dialogs: Vec::new(),
            _profile: profile,
        };
        let target = b.call("Target.createTarget", json!({"url": "about:blank"}));
        let attached = b.call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b.call("Page.navigate", json!({"url": url}));
        b
    }

    fn send(&mut self, method: &str, params: Value) -> u64 {
        self.next_id += 1;
        let mut msg = json!({"id": self.next_id, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = Value::String(self.session.clone());
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.commands.write_all(&bytes).unwrap();
        self.commands.flush().unwrap();
        self.next_id
    }

    /// Sends a command and waits for its reply, accepting any dialog the page opens
    /// meanwhile (a click that asks `confirm` answers only after the dialog closes).
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.send(method, params);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = self
                .events
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no reply to {method} from chromium: {e}"));
            if msg["id"].as_u64() == Some(id) {
                assert!(msg.get("error").is_none(), "{method} failed: {msg}");
                return msg["result"].clone();
            }
            if msg["method"] == "Page.javascriptDialogOpening" {
                self.dialogs
                    .push(msg["params"]["message"].as_str().unwrap_or("").to_string());
                self.send("Page.handleJavaScriptDialog", json!({"accept": true}));
            }
        }
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "awaitPromise": true, "returnByValue": true}),
        );
        assert!(
            r.get("exceptionDetails").is_none(),
            "{expression} threw: {r}"
        );
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page; on timeout, fails showing `what` and
    /// the page's text.
    fn wait_for(&mut self, expression: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.eval(&format!("!!({expression})")) == Value::Bool(true) {
                return;
            }
            if Instant::now() > deadline {
                let text = self.eval("document.body ? document.body.innerText : ''");
                panic!("timed out waiting for {what} ({expression}); the page shows:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Clicks the `action` button of `record` in the table `kind`.
    fn click(&mut self, kind: &str, action: &str, record: &str) {
        let selector = format!("#{kind} button[data-action={action}][data-record='{record}']");
        self.wait_for(
            &format!("document.querySelector({selector:?})"),
            &format!("the {action} button of {record}"),
        );
        self.eval(&format!("document.querySelector({selector:?}).click()"));
    }

    /// The text of the action result line once it mentions `needle`.
    fn action_result(&mut self, needle: &str) -> String {
        self.wait_for(
            &format!("document.getElementById('action').textContent.includes({needle:?})"),
            &format!("an action result with {needle:?}"),
        );
        self.eval("document.getElementById('action').className + ': ' + document.getElementById('action').textContent")
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Enters `token` in the page's token field as an operator would.
    fn enter_token(&mut self, token: &str) {
        self.eval(&format!(
            "(() => {{ const t = document.getElementById('token'); t.value = {token:?}; t.dispatchEvent(new Event('change')); }})()"
        ));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The admin server on a loopback port until the returned sender is dropped or fired.
async fn start_server(
    ledger: Arc<Ledger>,
    config: &Config,
    token: Option<String>,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let state = AdminState::new(ledger, config, token).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, state, async move {
        let _ = stopped.await;
    }));
    (format!("http://{addr}/"), stop, server)
}

fn record_exists(ledger: &Ledger, kind: RecordKind, sub: &str, rid: &str) -> bool {
    ledger.record(kind, sub, rid).unwrap().is_some()
}

/// The id of the only stored record of `kind` for `sub`.
fn only_record(ledger: &Ledger, kind: RecordKind, sub: &str, message_id: &str) -> String {
    let rows = ledger.records(kind, sub, None, 100).unwrap();
    rows.iter()
        .find(|r| r.body["id"] == message_id)
        .unwrap_or_else(|| panic!("no {kind:?} record of {message_id}"))
        .id
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_draws_trends_and_replays_and_discards_records_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse("[ledger]\nshards = 2\n").unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    for id in ["o-2", "o-3"] {
        submit(&ledger, "orders-dash", id, "{}");
        let q = submit(&ledger, "orders-dash", id, r#"{"x":1}"#);
        assert_eq!(q.name(), "quarantined");
    }
    submit(&ledger, "billing-dash", "b-1", "{}");
    for id in ["d-1", "d-2"] {
        ledger
            .add_dead_letter(
                "orders-dash",
                json!({"id": id, "payload": "{\"y\":2}", "reason": "handler said: try later"}),
            )
            .unwrap();
    }
    let q_replay = only_record(&ledger, RecordKind::Quarantine, "orders-dash", "o-2");
    let q_discard = only_record(&ledger, RecordKind::Quarantine, "orders-dash", "o-3");
    let d_replay = only_record(&ledger, RecordKind::DeadLetter, "orders-dash", "d-1");
    let d_discard = only_record(&ledger, RecordKind::DeadLetter, "orders-dash", "d-2");
    let (url, stop, server) = start_server(ledger.clone(), &config, None).await;

    // Traffic while the page polls, so the throughput curve has something to show.
    let flowing = Arc::new(AtomicBool::new(true));
    let traffic = {
        let (ledger, flowing) = (ledger.clone(), flowing.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while flowing.load(Ordering::Relaxed) {
                n += 1;
                submit(&ledger, "billing-dash", &format!("t-{n}"), "{}");
                submit(&ledger, "billing-dash", &format!("t-{n}"), "{}");
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let (q_r, q_d, d_r, d_d) = (
        q_replay.clone(),
        q_discard.clone(),
        d_replay.clone(),
        d_discard.clone(),
    );
    let (trends, results, dialogs) = tokio::task::spawn_blocking(move || {
        let mut b = Browser::open(&url);
        // Sparklines: one row per subscriber, three curves each with at least two points
        // (three polls), and the disk curve.
        b.wait_for(
            "document.querySelectorAll('#trends tbody tr').length === 2 && \
             [...document.querySelectorAll('#trends svg path')].length === 6 && \
             [...document.querySelectorAll('#trends svg path')].every(p => +p.dataset.points >= 2) && \
             +document.querySelector('#disk-trend svg path').dataset.points >= 2",
            "three curves per subscriber with two points each",
        );
        let trends = b.eval(
            "[...document.querySelectorAll('#trends tbody tr')].map(tr => ({ \
               subscriber: tr.cells[0].textContent, \
               paths: [...tr.querySelectorAll('svg path')].map(p => p.getAttribute('d')), \
               now: [...tr.querySelectorAll('.now')].map(n => n.textContent) }))",
        );
        let mut results = Vec::new();
        b.click("quarantine", "replay", &q_r);
        results.push(b.action_result("replayed"));
        b.wait_for(
            &format!("!document.querySelector(\"#quarantine button[data-record='{q_r}']\")"),
            "the replayed quarantine row to go",
        );
        b.click("deadletters", "replay", &d_r);
        results.push(b.action_result(&format!("replayed dead letter {d_r}")));
        b.click("deadletters", "discard", &d_d);
        results.push(b.action_result("discarded dead letter"));
        b.click("quarantine", "discard", &q_d);
        results.push(b.action_result("discarded quarantined"));
        b.wait_for(
            "document.querySelector('#deadletters td.empty') && document.querySelector('#quarantine td.empty')",
            "both tables to be empty",
        );
        (trends, results, b.dialogs.clone())
    })
    .await
    .unwrap();
    flowing.store(false, Ordering::Relaxed);
    traffic.join().unwrap();
    let _ = stop.send(());
    server.await.unwrap().unwrap();

    let rows = trends.as_array().unwrap();
    for row in rows {
        for d in row["paths"].as_array().unwrap() {
            let points = d.as_str().unwrap().matches(['M', 'L']).count();
            assert!(points >= 2, "a curve without points: {trends}");
        }
    }
    let billing = rows
        .iter()
        .find(|r| r["subscriber"] == "billing-dash")
        .unwrap();
    let rate = billing["now"][0].as_str().unwrap();
    assert!(
        rate.ends_with("msgs/s") && !rate.starts_with("0 "),
        "billing-dash took traffic: {trends}"
    );
    let dup: f64 = billing["now"][1]
        .as_str()
        .unwrap()
        .trim_end_matches(" %")
        .parse()
        .unwrap();
    assert!(
        (40.0..=60.0).contains(&dup),
        "every billing message came twice: {trends}"
    );
    assert!(
        billing["now"][2].as_str().unwrap().ends_with(" ms"),
        "{trends}"
    );

    assert!(results[0].contains(": processed"), "{results:?}");
    assert!(results[1].contains(": processed"), "{results:?}");
    assert!(
        results.iter().all(|r| r.starts_with("action ok")),
        "{results:?}"
    );
    assert_eq!(dialogs.len(), 2, "each discard asks first: {dialogs:?}");
    assert!(dialogs[0].contains(&format!("Discard dead letter {d_discard}")));
    assert!(dialogs[1].contains(&format!("Discard quarantined message {q_discard}")));
    for (kind, rid) in [
        (RecordKind::Quarantine, &q_replay),
        (RecordKind::Quarantine, &q_discard),
        (RecordKind::DeadLetter, &d_replay),
        (RecordKind::DeadLetter, &d_discard),
    ] {
        assert!(
            !record_exists(&ledger, kind, "orders-dash", rid),
            "{kind:?} {rid} is still stored"
        );
    }
    // The replays were processed: the claims now hold the replayed payloads.
    for (id, payload) in [("o-2", r#"{"x":1}"#), ("d-1", r#"{"y":2}"#)] {
        let claim = ledger
            .lookup("orders-dash", key_hash(id.as_bytes()))
            .unwrap()
            .unwrap_or_else(|| panic!("{id} has no claim"));
        assert_eq!(claim.fingerprint, fingerprint(payload.as_bytes()), "{id}");
    }
    // The discarded ones were not.
    assert!(ledger
        .lookup("orders-dash", key_hash(b"d-2"))
        .unwrap()
        .is_none());
    // Every decided message was counted for the ack-latency curve.
    let billing = ledger.subscriber("billing-dash").unwrap();
    let c = &billing.counters;
    assert_eq!(
        c.acked.load(Ordering::Relaxed),
        c.processed.load(Ordering::Relaxed) + c.duplicates.load(Ordering::Relaxed)
    );
    assert!(c.ack_latency_us.load(Ordering::Relaxed) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_actions_fail_visibly_without_the_token_and_succeed_with_it_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse("[ledger]\nshards = 2\n").unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    ledger
        .add_dead_letter(
            "guarded",
            json!({"id": "g-1", "payload": "{}", "reason": "try later"}),
        )
        .unwrap();
    let rid = only_record(&ledger, RecordKind::DeadLetter, "guarded", "g-1");
    let (url, stop, server) =
        start_server(ledger.clone(), &config, Some("s3cret-token".into())).await;
    let l = ledger.clone();
    let r = rid.clone();
    let (without, wrong, with, stored_between) = tokio::task::spawn_blocking(move || {
        let mut b = Browser::open(&url);
        b.click("deadletters", "replay", &r);
        let without = b.action_result("(401)");
        let stored = record_exists(&l, RecordKind::DeadLetter, "guarded", &r);
        b.enter_token("not-the-token");
        b.click("deadletters", "discard", &r);
        let wrong = b.action_result("(403)");
        let stored = stored && record_exists(&l, RecordKind::DeadLetter, "guarded", &r);
        b.enter_token("s3cret-token");
        b.click("deadletters", "replay", &r);
        let with = b.action_result("replayed");
        b.wait_for(
            "document.querySelector('#deadletters td.empty')",
            "the replayed row to go",
        );
        (without, wrong, with, stored)
    })
    .await
    .unwrap();
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    assert!(
        without.starts_with("action bad") && without.contains("API token"),
        "{without}"
    );
    assert!(wrong.starts_with("action bad"), "{wrong}");
    assert!(stored_between, "a refused action changed nothing");
    assert!(
        with.starts_with("action ok") && with.contains(": processed"),
        "{with}"
    );
    assert!(!record_exists(
        &ledger,
        RecordKind::DeadLetter,
        "guarded",
        &rid
    ));
    assert!(ledger
        .lookup("guarded", key_hash(b"g-1"))
        .unwrap()
        .is_some());
}
