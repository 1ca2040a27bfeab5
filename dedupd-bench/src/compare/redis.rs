//! Redis as a dedup store: `SET <subscriber>:<id> 1 NX EX 604800` (7 days), `OK` counted as
//! new, nil as a duplicate. The only module that imports the `redis` crate.

use std::time::Instant;

use super::server::{start_redis, tree_allocated_bytes, tree_memory_bytes};
use super::{PeerRun, Workload};

/// The TTL a dedup key gets: 7 days, as in the hand measurement.
const TTL_SECS: u64 = 604_800;

/// Starts a server with `appendfsync` (`everysec` or `always`), loads the workload with
/// `clients` connections sending one request at a time (`pipelined: false`) or one
/// connection pipelining `batch` requests (`pipelined: true`), measures, stops the server.
pub fn run(w: &Workload, appendfsync: &str, pipelined: bool) -> Result<PeerRun, String> {
    let server = start_redis(&w.dir, appendfsync)?;
    let client = redis::Client::open(format!("redis://127.0.0.1:{}/", server.port)).map_err(rd)?;
    let mut admin = client.get_connection().map_err(rd)?;
    let used = |con: &mut redis::Connection| -> Result<u64, String> {
        let info: String = redis::cmd("INFO").arg("memory").query(con).map_err(rd)?;
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| "INFO memory has no used_memory".to_string())
    };
    let used_base = used(&mut admin)?;
    let mem_base = tree_memory_bytes(server.pid());
    let disk_base = tree_allocated_bytes(&server.data_dir);
    let clients = if pipelined { 1 } else { w.clients.max(1) };
    let start = Instant::now();
    let parts: Vec<Result<PeerRun, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let client = &client;
                s.spawn(move || load(client, w, pipelined, i, clients))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("client panicked".into())))
            .collect()
    });
    let mut run = PeerRun::default();
    for p in parts {
        run.add(p?);
    }
    run.elapsed = start.elapsed();
    run.stored_keys = redis::cmd("DBSIZE").query(&mut admin).map_err(rd)?;
    run.memory_bytes = tree_memory_bytes(server.pid()).saturating_sub(mem_base);
    run.used_memory_bytes = Some(used(&mut admin)?.saturating_sub(used_base));
    run.disk_bytes = tree_allocated_bytes(&server.data_dir).saturating_sub(disk_base);
    Ok(run)
}

fn rd(e: redis::RedisError) -> String {
    format!("redis: {e}")
}

fn set_nx(subscriber: &str, id: &str) -> redis::Cmd {
    let mut c = redis::cmd("SET");
    c.arg(format!("{subscriber}:{id}"))
        .arg(1)
        .arg("NX")
        .arg("EX")
        .arg(TTL_SECS);
    c
}

/// One client's share: every `clients`-th message starting at `index`.
fn load(
    client: &redis::Client,
    w: &Workload,
    pipelined: bool,
    index: u32,
    clients: u32,
) -> Result<PeerRun, String> {
    let mut con = client.get_connection().map_err(rd)?;
    let mut run = PeerRun::default();
    let mut messages = w.messages(index, clients).peekable();
    if !pipelined {
        for (id, expect) in messages {
            run.expect(expect);
            let t = Instant::now();
            let r: Option<String> = set_nx(&w.subscriber, &id).query(&mut con).map_err(rd)?;
            run.latency.record_us(t.elapsed().as_micros() as u64);
            run.processed += u64::from(r.is_some());
        }
        return Ok(run);
    }
    while messages.peek().is_some() {
        let mut pipe = redis::pipe();
        for (id, expect) in messages.by_ref().take(w.batch as usize) {
            run.expect(expect);
            pipe.add_command(set_nx(&w.subscriber, &id));
        }
        let t = Instant::now();
        let replies: Vec<Option<String>> = pipe.query(&mut con).map_err(rd)?;
        run.latency.record_us(t.elapsed().as_micros() as u64);
        run.processed += replies.iter().filter(|r| r.is_some()).count() as u64;
    }
    Ok(run)
}
