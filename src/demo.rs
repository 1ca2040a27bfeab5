//! `dedupd demo`: a self-contained tour on a temporary data directory. It generates
//! traffic with redeliveries and reused ids, then "restarts" the engine and redelivers the
//! first part of the stream as a broker would after a crash, showing that nothing is
//! processed twice.

use std::path::PathBuf;
use std::sync::Arc;

use crossbeam_channel::unbounded;
use serde::Serialize;

use crate::bench::{self, BenchError, BenchParams, BenchReport, Progress};
use crate::clock::SystemClock;
use crate::config::Config;
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{disk_usage, DiskUsage, Job, Ledger, Outcome};
use crate::source::generator::{Event, Traffic, TrafficSpec};

/// What the demo shows at the end.
#[derive(Debug, Serialize)]
pub struct DemoReport {
    pub(crate) run: BenchReport,
    pub(crate) redelivered: u64,
    pub(crate) redelivered_processed_again: u64,
    pub(crate) redelivered_duplicates: u64,
    pub(crate) redelivered_quarantined: u64,
    /// Handler state entries (labels) before and after the redelivery: equal.
    pub(crate) labels_after_redelivery: u64,
    /// Where the bytes on disk went, after the restart.
    pub(crate) disk: DiskShares,
}

/// The data directory's bytes by what they hold, so the demo's bytes per claim can be
/// read against the per-key figures elsewhere (which count claims alone).
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub(crate) struct DiskShares {
    /// Claim blocks and logs, generations, filters, placements, key sources.
    pub(crate) claims: u64,
    /// Handler state: runs, the state log, marks, versions.
    pub(crate) handler_state: u64,
    /// Quarantine and dead-letter records, the outbox, changelog checkpoints, meta.
    pub(crate) records_and_other_tables: u64,
    /// Free pages kept for reuse and redb's own tables and headers.
    pub(crate) free_and_redb: u64,
}

impl DiskShares {
    /// Shares of `usage`, by table kind (the prefix of a table's name).
    pub(crate) fn of(usage: &DiskUsage) -> DiskShares {
        let mut d = DiskShares {
            free_and_redb: usage.other_bytes,
            ..DiskShares::default()
        };
        for g in &usage.groups {
            let bytes = g.page_bytes();
            match g.kind.as_str() {
                "claimblk_v1" | "claims_v1" | "claimlog_v1" | "generations_v1" | "filters_v1"
                | "placements_v1" | "key_sources_v1" => d.claims += bytes,
                "state_v2" | "unique_v2" | "versions_v2" | "statelog_v1" | "staterun_v1"
                | "stateruns_v1" => d.handler_state += bytes,
                _ => d.records_and_other_tables += bytes,
            }
        }
        d
    }

    pub(crate) fn total(&self) -> u64 {
        self.claims + self.handler_state + self.records_and_other_tables + self.free_and_redb
    }
}

impl DemoReport {
    /// What the demo promises: every outcome verified, and a restart plus redelivery
    /// processes nothing again and makes no new label.
    pub fn holds(&self) -> bool {
        self.run.verified
            && self.redelivered_processed_again == 0
            && self.labels_after_redelivery == self.run.state_entries
    }
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.run;
        let messages = r.params.messages;
        writeln!(
            f,
            "throughput     {:.0} msgs/s ({} msgs in {:.2} s)",
            r.msgs_per_sec, messages, r.elapsed_s
        )?;
        writeln!(
            f,
            "outcomes       {} processed, {} duplicates skipped ({:.1}%), {} quarantined",
            r.processed,
            r.duplicates,
            100.0 * r.duplicates as f64 / messages as f64,
            r.quarantined
        )?;
        writeln!(
            f,
            "ack latency    p50 {:.2} ms, p99 {:.2} ms",
            r.p50_ack_ms, r.p99_ack_ms
        )?;
        let mib = |b: u64| b as f64 / 1048576.0;
        let per_claim = |b: u64| b as f64 / r.stored_keys.max(1) as f64;
        let d = &self.disk;
        writeln!(
            f,
            "on disk        {:.1} MiB for {} claims ({:.0} B per claim, everything in):",
            mib(d.total()),
            r.stored_keys,
            per_claim(d.total())
        )?;
        for (what, bytes) in [
            ("claims (the per-key figures count these)", d.claims),
            ("handler state (labels, marks, logs)", d.handler_state),
            (
                "records, outbox and other tables",
                d.records_and_other_tables,
            ),
            ("free pages kept for reuse, redb's own", d.free_and_redb),
        ] {
            writeln!(
                f,
                "  {what:<42} {:>8.1} MiB  {:>5.0} B per claim",
                mib(bytes),
                per_claim(bytes)
            )?;
        }
        if r.params.handler.is_some() {
            writeln!(f, "labels         {} created for {} processed events ({} events repeated an order and made no label); {} dead-lettered",
                r.state_entries, r.processed, r.processed - r.state_entries, r.dead_lettered)?;
        }
        writeln!(f, "verified       {}", r.verified)?;
        writeln!(f, "restart + redelivery of the first {} messages: {} processed again, {} duplicates, {} quarantined; labels {} -> {}",
            self.redelivered, self.redelivered_processed_again, self.redelivered_duplicates, self.redelivered_quarantined,
            r.state_entries, self.labels_after_redelivery)
    }
}

/// Runs the demo. `messages` is the length of the first stream.
pub fn run(
    messages: u64,
    dir: PathBuf,
    handler: Option<PathBuf>,
    progress: impl FnMut(Progress),
) -> Result<DemoReport, BenchError> {
    let params = BenchParams {
        messages,
        dup_rate: 0.12,
        mismatch_rate: 0.002,
        subscribers: 3,
        seed: 2026,
        window: 8_192,
        naive_messages: 0,
        dir,
        keep: true,
        handler: handler.clone(),
        partition_pointer: Some("/order_id".into()),
        random_order_ids: false,
        orders: None,
        series_step: 1_000_000,
        rate: None,
        config: Config::default(),
    };
    let run = bench::run(&params, progress)?;
    // Restart on the same files and redeliver the first part of the stream.
    let ledger = Ledger::open(
        &run.data_dir,
        &bench::bench_config(&params),
        Arc::new(SystemClock),
    )?;
    let redeliver = (messages / 5).max(1);
    let mut traffic = Traffic::new(TrafficSpec {
        seed: params.seed,
        messages: redeliver,
        dup_rate: params.dup_rate,
        mismatch_rate: params.mismatch_rate,
        subscribers: params.subscribers,
        random_order_ids: false,
        orders: None,
    });
    let subs: Vec<_> = (0..params.subscribers)
        .map(|i| ledger.subscriber(&format!("bench-{i}")))
        .collect::<Result<_, _>>()?;
    if let Some(path) = &handler {
        let factory = crate::handler::load_factory(path, crate::handler::Limits::default())?;
        for s in &subs {
            ledger.set_handler(&s.name, Some(factory.clone()))?;
        }
    }
    let (tx, rx) = unbounded::<Vec<crate::ledger::Done>>();
    let mut ev = Event::default();
    let mut seq = 0;
    let mut counts = [0u64; 3];
    let collect = |counts: &mut [u64; 3], wait_for: u64| {
        let mut got = 0;
        while got < wait_for {
            let Ok(batch) = rx.recv() else { break };
            for d in batch {
                got += 1;
                match d.outcome {
                    Outcome::Processed => counts[0] += 1,
                    Outcome::Duplicate => counts[1] += 1,
                    _ => counts[2] += 1,
                }
            }
        }
    };
    let mut in_flight = 0u64;
    while traffic.next_into(&mut ev) {
        let key = key_hash(ev.id.as_bytes());
        let sub = &subs[ev.subscriber as usize];
        let mut job = Job::new(
            seq,
            sub.id,
            key,
            fingerprint(&ev.payload),
            &ev.id,
            &ev.payload,
            tx.clone(),
        );
        let shard = bench::place_event(&ledger, sub, &sub.settings(), &mut job)?;
        ledger.submit(shard, vec![job])?;
        seq += 1;
        in_flight += 1;
        if in_flight >= 8192 {
            collect(&mut counts, in_flight);
            in_flight = 0;
        }
    }
    collect(&mut counts, in_flight);
    let mut labels_after = 0;
    for s in &subs {
        labels_after += ledger.state_len(&s.name)?;
    }
    let shards = ledger.shard_count();
    ledger.close()?;
    let disk = DiskShares::of(&disk_usage(&run.data_dir, shards)?);
    let _ = std::fs::remove_dir_all(run.data_dir.parent().unwrap_or(&run.data_dir));
    Ok(DemoReport {
        run,
        redelivered: seq,
        redelivered_processed_again: counts[0],
        redelivered_duplicates: counts[1],
        redelivered_quarantined: counts[2],
        labels_after_redelivery: labels_after,
        disk,
    })
}
