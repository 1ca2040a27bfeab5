//! `dedupd config check FILE` as a process: a valid config passes with a summary; each kind
//! of mistake `dedupd run` would stop on fails with the field named; the check opens no
//! data directory and connects to no broker.
#![allow(
    clippy::unwrap_used,
    reason = "helpers outside #[test]: a failed unwrap is a failed test"
)]

mod common;

use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_dedupd");

/// What one `dedupd config check` produced.
struct Checked {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Writes `text` as `dedupd.toml` in `dir` and runs `dedupd config check` on it.
fn check(dir: &Path, text: &str) -> Checked {
    let file = dir.join("dedupd.toml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(BIN)
        .args(["config", "check"])
        .arg(&file)
        .output()
        .unwrap();
    Checked {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Asserts the check passed, showing its output otherwise.
fn assert_passed(c: &Checked) {
    assert_eq!(
        c.code,
        Some(0),
        "stdout: {}\nstderr: {}",
        c.stdout,
        c.stderr
    );
}

/// Runs the check and asserts it failed with `needle` in its message.
fn fails_naming(text: &str, needle: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let c = check(dir.path(), text);
    assert_eq!(
        c.code,
        Some(1),
        "stdout: {}\nstderr: {}",
        c.stdout,
        c.stderr
    );
    assert!(c.stderr.contains(needle), "{needle:?} not in: {}", c.stderr);
    assert!(c.stdout.is_empty(), "no summary on failure: {}", c.stdout);
    c.stderr
}

/// A subscriber with a real handler component, the HTTP API and a Kafka source whose
/// broker is `brokers`.
fn full_config(data_dir: &Path, brokers: &str) -> String {
    let handler = common::component("shipping_label");
    format!(
        r#"data_dir = {data_dir:?}

[[subscriber]]
name = "orders"
key = {{ source = "header", name = "message-id" }}
partition_key = {{ source = "json_pointer", pointer = "/order_id" }}
handler = {handler:?}

[http]
bind = "127.0.0.1:18080"

[kafka]
brokers = "{brokers}"
dead_letter_topic = "orders-dlq"
options = {{ "client.id" = "dedupd-check" }}

[[kafka.subscription]]
subscriber = "orders"
topics = ["orders"]
"#,
        data_dir = data_dir.display().to_string(),
        handler = handler.display().to_string(),
    )
}

#[test]
fn valid_config_with_a_handler_passes_and_prints_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let text = full_config(&dir.path().join("data"), "127.0.0.1:9");
    let c = check(dir.path(), &text);
    assert_eq!(c.code, Some(0), "stderr: {}", c.stderr);
    let out = &c.stdout;
    assert!(out.starts_with("config ok\n"), "{out}");
    let orders = out
        .lines()
        .find(|l| l.starts_with("subscriber orders "))
        .unwrap_or_else(|| panic!("no line for orders: {out}"));
    for part in [
        "key header message-id",
        "placement by entity (json_pointer /order_id)",
        "shipping_label.wasm (checked)",
    ] {
        assert!(orders.contains(part), "{part:?} not in {orders:?}");
    }
    assert!(out.contains("sources    kafka, http\n"), "{out}");
    assert!(out.contains("kafka      orders <- orders"), "{out}");
    assert!(out.contains("http       127.0.0.1:18080"), "{out}");
}

#[test]
fn check_creates_no_data_directory_and_connects_to_no_broker() {
    let broker = TcpListener::bind("127.0.0.1:0").unwrap();
    broker.set_nonblocking(true).unwrap();
    let brokers = broker.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let c = check(dir.path(), &full_config(&data, &brokers));
    assert_eq!(c.code, Some(0), "stderr: {}", c.stderr);
    assert!(!data.exists(), "config check created {}", data.display());
    // The process has exited: a connection it made would wait in the listen backlog.
    match broker.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("config check connected to the broker from {peer}"),
        Err(e) => panic!("accept: {e}"),
    }
}

#[test]
fn missing_handler_fails_naming_the_subscriber() {
    let text = "[[subscriber]]\nname = \"orders\"\nhandler = \"missing.wasm\"\n";
    let err = fails_naming(text, "subscriber \"orders\": handler: cannot read handler");
    assert!(err.contains("missing.wasm"), "{err}");
}

#[test]
fn non_component_handler_fails_naming_the_subscriber() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("label.wasm"), b"not a component").unwrap();
    let text = "[[subscriber]]\nname = \"labels\"\nhandler = \"label.wasm\"\n";
    let c = check(dir.path(), text);
    assert_eq!(c.code, Some(1), "{}", c.stdout);
    assert!(
        c.stderr.contains("subscriber \"labels\": handler: ")
            && c.stderr.contains("is not a valid WebAssembly component"),
        "{}",
        c.stderr
    );
}

#[test]
fn bad_key_source_fails_naming_the_field() {
    fails_naming(
        "[[subscriber]]\nname = \"orders\"\nkey = { source = \"json_pointer\", pointer = \"order_id\" }\n",
        "subscriber[0].key.pointer",
    );
    fails_naming(
        "[[subscriber]]\nname = \"orders\"\npartition_key = { source = \"json_pointer\", pointer = \"order_id\" }\n",
        "subscriber[0].partition_key.pointer",
    );
}

#[test]
fn out_of_range_ledger_setting_fails_naming_the_field_and_range() {
    fails_naming(
        "[ledger]\nmax_batch = 100000000000\n",
        "ledger.max_batch` is 100000000000; it must be between 1 and 1048576",
    );
    fails_naming(
        "[ledger]\ngeneration_max_claims = 4\n",
        "ledger.generation_max_claims",
    );
}

#[test]
fn bad_http_token_rule_fails_naming_the_field() {
    fails_naming("[http]\ntoken = \"short\"\n", "http.token");
    fails_naming("[http]\nbind = \"0.0.0.0:8080\"\n", "http.bind");
}

/// A self-signed CA in PEM, made with the `openssl` command (`scripts/test` installs it).
fn make_ca(dir: &Path) -> std::path::PathBuf {
    let ca = dir.join("ca.pem");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=dedupd-test-ca",
            "-keyout",
        ])
        .arg(dir.join("ca.key"))
        .arg("-out")
        .arg(&ca)
        .output()
        .expect("the openssl command (scripts/test installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ca
}

fn tls_config(ca: &Path, protocol: &str, extra: &str) -> String {
    format!(
        "[[subscriber]]\nname = \"orders\"\nkey = {{ source = \"header\", name = \"id\" }}\n\
         [kafka]\nbrokers = \"127.0.0.1:9\"\n\
         options = {{ \"security.protocol\" = \"{protocol}\", \"ssl.ca.location\" = {ca:?}{extra} }}\n\
         [[kafka.subscription]]\nsubscriber = \"orders\"\ntopics = [\"orders\"]\n"
    )
}

/// librdkafka is built with OpenSSL and SASL: a TLS client with a CA file, and SASL_SSL
/// with SCRAM whose password comes from the environment, are created (they failed with
/// "not available at build time" before); a CA file that does not exist is refused.
#[test]
fn tls_and_sasl_ssl_clients_are_accepted_and_a_missing_ca_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = make_ca(dir.path());
    let c = check(dir.path(), &tls_config(&ca, "SSL", ""));
    assert_passed(&c);

    let scram = ", \"sasl.mechanisms\" = \"SCRAM-SHA-256\", \"sasl.username\" = \"svc\", \
                 \"sasl.password\" = \"${DEDUPD_TEST_SASL_PASSWORD}\"";
    let file = dir.path().join("sasl.toml");
    std::fs::write(&file, tls_config(&ca, "SASL_SSL", scram)).unwrap();
    let run = |password: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args(["config", "check"]).arg(&file);
        match password {
            Some(p) => cmd.env("DEDUPD_TEST_SASL_PASSWORD", p),
            None => cmd.env_remove("DEDUPD_TEST_SASL_PASSWORD"),
        };
        cmd.output().unwrap()
    };
    let ok = run(Some("pa\"ss"));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let unset = run(None);
    let err = String::from_utf8_lossy(&unset.stderr);
    assert_eq!(unset.status.code(), Some(1), "{err}");
    assert!(
        err.contains("kafka.options.sasl.password") && err.contains("DEDUPD_TEST_SASL_PASSWORD"),
        "{err}"
    );

    let missing = dir.path().join("no-such-ca.pem");
    fails_naming(&tls_config(&missing, "SSL", ""), "ssl.ca.location");
}

/// librdkafka is built with Cyrus SASL (`gssapi`): a Kerberos client is created (before,
/// "No provider for SASL mechanism GSSAPI: recompile librdkafka with libsasl2"), and the
/// check runs no `kinit` to do so.
#[test]
fn sasl_plaintext_gssapi_client_is_accepted_without_running_kinit() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[[subscriber]]\nname = \"orders\"\nkey = { source = \"header\", name = \"id\" }\n\
                [kafka]\nbrokers = \"127.0.0.1:9\"\n\
                options = { \"security.protocol\" = \"SASL_PLAINTEXT\", \"sasl.mechanisms\" = \"GSSAPI\", \
                \"sasl.kerberos.service.name\" = \"kafka\", \"sasl.kerberos.principal\" = \"dedupd@EXAMPLE.COM\", \
                \"sasl.kerberos.keytab\" = \"/etc/security/keytabs/dedupd.keytab\" }\n\
                [[kafka.subscription]]\nsubscriber = \"orders\"\ntopics = [\"orders\"]\n";
    let c = check(dir.path(), text);
    assert_passed(&c);
    assert!(c.stdout.contains("options accepted"), "{}", c.stdout);
    assert!(
        !c.stderr.contains("kinit") && !c.stderr.contains("SASLREFRESH"),
        "the check ran kinit: {}",
        c.stderr
    );
}

#[test]
fn unknown_librdkafka_option_fails_naming_it() {
    let text = "[[subscriber]]\nname = \"orders\"\nkey = { source = \"header\", name = \"id\" }\n\
                [kafka]\nbrokers = \"127.0.0.1:9\"\noptions = { \"no.such.option\" = \"1\" }\n\
                [[kafka.subscription]]\nsubscriber = \"orders\"\ntopics = [\"orders\"]\n";
    fails_naming(text, "kafka.options.\"no.such.option\": ");
}

#[test]
fn json_summary_lists_subscribers_and_sources() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dedupd.toml");
    std::fs::write(&file, "[[subscriber]]\nname = \"orders\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["config", "check", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["subscribers"][0]["name"], "orders");
    assert_eq!(v["subscribers"][0]["placement"], "by key");
    assert_eq!(v["sources"], serde_json::json!(["stdin"]));
    assert_eq!(v["http_bind"], serde_json::Value::Null);
}

/// An error's cause is said once (it was printed twice: in the error's own text and again
/// as anyhow's cause), for a missing config file and a missing handler alike.
#[test]
fn error_causes_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["config", "check"])
        .arg(dir.path().join("no-such.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    let c = check(
        dir.path(),
        "[[subscriber]]\nname = \"orders\"\nhandler = \"missing.wasm\"\n",
    );
    assert_eq!(c.stderr.matches("os error 2").count(), 1, "{}", c.stderr);
}
