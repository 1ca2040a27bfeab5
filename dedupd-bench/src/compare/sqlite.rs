//! SQLite as a dedup store, in process: the seeds' `processed_message` table, WAL with
//! `synchronous=FULL` (the WAL is fsynced at every commit), `INSERT OR IGNORE` of `batch`
//! messages per transaction. The only module that imports `rusqlite`.

use std::time::Instant;

use rusqlite::Connection;

use super::server::tree_allocated_bytes;
use super::{PeerRun, Workload};
use dedupd::telemetry::{rss_bytes, Latency};

pub fn run(w: &Workload) -> Result<PeerRun, String> {
    let scratch = tempfile::Builder::new()
        .prefix(".dedupd-compare-sqlite-")
        .tempdir_in(&w.dir)
        .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
    let e = |e: rusqlite::Error| format!("sqlite: {e}");
    let mut db = Connection::open(scratch.path().join("dedup.sqlite")).map_err(e)?;
    let mode: String = db
        .query_row("pragma journal_mode = wal", [], |r| r.get(0))
        .map_err(e)?;
    if mode != "wal" {
        return Err(format!("sqlite: journal_mode is {mode}, not wal"));
    }
    db.execute_batch(
        "pragma synchronous = full;
         create table processed_message (
             subscriber_id text not null,
             message_id text not null,
             processed_at integer not null default (unixepoch()),
             primary key (subscriber_id, message_id)
         ) without rowid;",
    )
    .map_err(e)?;
    let mem_base = rss_bytes();
    let disk_base = tree_allocated_bytes(scratch.path());
    let mut run = PeerRun {
        latency: Latency::default(),
        ..PeerRun::default()
    };
    let start = Instant::now();
    let mut messages = w.messages(0, 1).peekable();
    while messages.peek().is_some() {
        let t = Instant::now();
        let tx = db.transaction().map_err(e)?;
        {
            let mut stmt = tx
                .prepare_cached(
                    "insert or ignore into processed_message (subscriber_id, message_id) values (?1, ?2)",
                )
                .map_err(e)?;
            for (id, expect) in messages.by_ref().take(w.batch as usize) {
                run.expect(expect);
                run.processed += stmt.execute((&w.subscriber, &id)).map_err(e)? as u64;
            }
        }
        tx.commit().map_err(e)?;
        run.latency.record_us(t.elapsed().as_micros() as u64);
    }
    run.elapsed = start.elapsed();
    run.stored_keys = db
        .query_row("select count(*) from processed_message", [], |r| {
            r.get::<_, i64>(0)
        })
        .map_err(e)? as u64;
    run.memory_bytes = rss_bytes().saturating_sub(mem_base);
    run.disk_bytes = tree_allocated_bytes(scratch.path()).saturating_sub(disk_base);
    Ok(run)
}
