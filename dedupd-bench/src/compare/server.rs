//! Peer servers the comparison starts itself: PostgreSQL and Redis from the Debian
//! packages, on loopback, in scratch directories, stopped when dropped. Also what the
//! comparison measures from outside a process: resident memory of a process tree and
//! allocated bytes of a directory tree.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process the comparison started; killed (and its data removed) on drop.
pub struct Server {
    child: Child,
    /// Stops the server cleanly before the kill (PostgreSQL's `pg_ctl stop`).
    stop: Option<Command>,
    pub port: u16,
    pub data_dir: PathBuf,
    _scratch: tempfile::TempDir,
}

impl Server {
    /// The process whose tree holds the server's memory.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.as_mut() {
            let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on loopback (bound, read, released: the server binds it next).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// PostgreSQL's server binaries: the newest `/usr/lib/postgresql/<version>/bin` (Debian's
/// layout; they are not on `PATH`), else `PATH`.
fn postgres_bin(name: &str) -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin").join(name)))
        })
        .filter(|(_, p)| p.exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, p)| p).or_else(|| on_path(name))
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// PostgreSQL refuses to run as root: as root, its commands run as the `postgres` user
/// (created by the Debian package) through `runuser`; otherwise as the caller.
fn as_postgres_user(program: &Path) -> Result<(Command, Option<(u32, u32)>), String> {
    if !is_root() {
        return Ok((Command::new(program), None));
    }
    let id = |flag: &str| -> Result<u32, String> {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .map_err(|e| format!("cannot run id: {e}"))?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| "running as root and there is no postgres user to run PostgreSQL as (install the postgresql package)".to_string())
    };
    let owner = (id("-u")?, id("-g")?);
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(program);
    Ok((c, Some(owner)))
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

/// Runs a setup command to completion; its stderr becomes the reason when it fails.
fn run(mut c: Command, what: &str) -> Result<(), String> {
    let out = c
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(format!("{what} failed: {}", err.trim()))
}

/// Starts a PostgreSQL server on loopback: `initdb` into a scratch directory under `dir`,
/// then `postgres` with `fsync` and `synchronous_commit` on (the defaults, set explicitly).
/// The superuser is `dedupd` with trust authentication on loopback only.
pub fn start_postgres(dir: &Path) -> Result<Server, String> {
    let initdb = postgres_bin("initdb").ok_or(
        "PostgreSQL's initdb not found (install the postgresql package: apt-get install postgresql)",
    )?;
    let postgres = postgres_bin("postgres").ok_or("PostgreSQL's postgres binary not found")?;
    let scratch = scratch(dir, "pg")?;
    let data = scratch.path().join("data");
    let (mut init, owner) = as_postgres_user(&initdb)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(scratch.path(), Some(uid), Some(gid))
            .map_err(|e| format!("cannot hand {} to postgres: {e}", scratch.path().display()))?;
    }
    init.arg("-D").arg(&data).args([
        "-U",
        "dedupd",
        "--auth=trust",
        "-E",
        "UTF8",
        "--no-instructions",
    ]);
    run(init, "initdb")?;
    let port = free_port().map_err(|e| format!("no free port: {e}"))?;
    let (mut cmd, _) = as_postgres_user(&postgres)?;
    cmd.arg("-D")
        .arg(&data)
        .args(["-p", &port.to_string()])
        .args(["-c", "listen_addresses=127.0.0.1"])
        .arg("-c")
        .arg(format!("unix_socket_directories={}", data.display()))
        .args(["-c", "fsync=on", "-c", "synchronous_commit=on"])
        .args(["-c", "max_connections=40"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start postgres: {e}"))?;
    let (mut stop, _) = as_postgres_user(&postgres_bin("pg_ctl").unwrap_or("pg_ctl".into()))?;
    stop.args(["stop", "-m", "fast", "-w", "-D"]).arg(&data);
    let server = Server {
        child,
        stop: Some(stop),
        port,
        data_dir: data,
        _scratch: scratch,
    };
    wait_for_port(port, Duration::from_secs(30)).map_err(|e| format!("postgres {e}"))?;
    Ok(server)
}

/// Starts `redis-server` on loopback with an append-only file fsynced as `appendfsync`
/// says (`everysec` or `always`) and no RDB snapshots.
pub fn start_redis(dir: &Path, appendfsync: &str) -> Result<Server, String> {
    let bin = on_path("redis-server")
        .ok_or("redis-server not found (install the redis-server package)")?;
    let scratch = scratch(dir, "redis")?;
    let port = free_port().map_err(|e| format!("no free port: {e}"))?;
    let child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(scratch.path())
        .args(["--appendonly", "yes", "--appendfsync", appendfsync])
        .args(["--save", "", "--daemonize", "no", "--protected-mode", "no"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server: {e}"))?;
    let server = Server {
        child,
        stop: None,
        port,
        data_dir: scratch.path().to_path_buf(),
        _scratch: scratch,
    };
    wait_for_port(port, Duration::from_secs(15)).map_err(|e| format!("redis-server {e}"))?;
    Ok(server)
}

fn scratch(dir: &Path, what: &str) -> Result<tempfile::TempDir, String> {
    tempfile::Builder::new()
        .prefix(&format!(".dedupd-compare-{what}-"))
        .tempdir_in(dir)
        .map_err(|e| {
            format!(
                "cannot create a scratch directory in {}: {e}",
                dir.display()
            )
        })
}

fn wait_for_port(port: u16, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "did not accept connections on 127.0.0.1:{port} within {limit:?}"
    ))
}

/// Resident memory of a process and all its descendants, as proportional set size (shared
/// pages such as PostgreSQL's shared buffers are counted once across the processes, not
/// once per process); falls back to RSS where `smaps_rollup` is unreadable.
pub fn tree_memory_bytes(root: u32) -> u64 {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // The parent is the 2nd field after the parenthesised command name.
        let ppid = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                let rest = &s[s.rfind(')')? + 1..];
                rest.split_whitespace().nth(1)?.parse::<u32>().ok()
            });
        if let Some(ppid) = ppid {
            parents.push((pid, ppid));
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    tree.iter().map(|p| process_memory_bytes(*p)).sum()
}

fn process_memory_bytes(pid: u32) -> u64 {
    let kib = |text: &str, field: &str| {
        text.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
    };
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| kib(&s, "Pss:"))
        .or_else(|| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| kib(&s, "VmRSS:"))
        })
        .unwrap_or(0)
        * 1024
}

/// Bytes a directory tree takes on the disk (allocated blocks, as `du` counts).
pub fn tree_allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.path(), e.metadata().ok()?)))
        .map(|(p, m)| {
            if m.is_dir() {
                tree_allocated_bytes(&p)
            } else {
                m.blocks() * 512
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_counts_nested_files_and_this_process_has_memory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/f"), vec![1u8; 64 * 1024]).unwrap();
        assert!(tree_allocated_bytes(dir.path()) >= 64 * 1024);
        assert!(tree_memory_bytes(std::process::id()) > 0);
    }
}
