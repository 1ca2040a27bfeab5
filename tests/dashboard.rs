//! The dashboard in a real headless browser: the engine's server runs on a loopback port,
//! Chromium loads `/` (no network access beyond it) and dumps the DOM after the page's
//! scripts rendered; the test checks what an operator would see. Chromium comes from the
//! Debian `chromium` package (`.ci/run` installs it); without it this test fails.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::admin::{serve, AdminState};
use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::envelope::{fingerprint, key_hash};
use dedupd::ledger::{Job, Ledger, Outcome};
use serde_json::json;

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

/// Runs Chromium headless on `url` and returns the DOM after the scripts ran.
fn dump_dom(url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(chromium())
        .args([
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
