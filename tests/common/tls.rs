//! Certificates for the broker tests' TLS listeners, made at test time with the `openssl`
//! command (`scripts/test` installs it; `tests/config_cli.rs` makes its CA the same way):
//! a CA, a server certificate it signs for `DNS:localhost, IP:127.0.0.1`, a client
//! certificate it signs (mutual TLS), and a second CA that signed neither (a wrong CA).
//! EC P-256 keys, PKCS#8 PEM (what every client and server here reads), valid two days.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The files of one test's PKI, in a directory of the test's.
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA of its own, which signed nothing here.
    pub other_ca: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command (scripts/test installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `NAME.pem` with its key `NAME.key`.
fn ca(dir: &Path, name: &str) {
    openssl(
        &[
            "-subj",
            &format!("/CN=dedupd test {name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        dir,
    );
}

/// A certificate `NAME.pem` (key `NAME.key`) signed by `ca`, for `usage` (serverAuth,
/// clientAuth), with the loopback names.
fn leaf(dir: &Path, name: &str, cn: &str, usage: &str) {
    openssl(
        &[
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:FALSE",
            "-addext",
            &format!("extendedKeyUsage={usage}"),
        ],
        dir,
    );
}

impl Pki {
    /// Makes the files in `dir`.
    pub fn make(dir: &Path) -> Pki {
        ca(dir, "ca");
        ca(dir, "other-ca");
        leaf(dir, "server", "localhost", "serverAuth");
        leaf(dir, "client", "dedupd-client", "clientAuth");
        Pki {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.pem"),
        }
    }
}
