//! How `dedupd bench` prints its live line and its report.

use std::fmt;

use super::{bench_config, BenchParams, BenchReport, Progress};

impl fmt::Display for BenchParams {
    /// The line `dedupd bench` starts with.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bench: {} messages, dup rate {}, mismatch rate {}, {} subscriber(s), seed {}, window {}, durable commits",
            self.messages, self.dup_rate, self.mismatch_rate, self.subscribers, self.seed, self.window
        )?;
        if self.random_order_ids {
            write!(f, ", random order ids")?;
        }
        if let Some(orders) = self.orders {
            write!(f, ", {orders} orders")?;
        }
        if let Some(rate) = self.rate {
            write!(f, ", offered at {rate} msgs/s")?;
        }
        if self.handler.is_some() {
            let effective = bench_config(self).defaults.partition_key;
            write!(f, ", partition key {effective:?}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Progress {
    /// One live line (without the carriage return): phase, percent, messages, rate, p99.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = self.done as f64 / self.elapsed.as_secs_f64().max(1e-9);
        write!(
            f,
            "{:>6} {:>5.1}%  {:>10} msgs  {:>9.0} msgs/s  p99 {:>7.2} ms",
            self.phase,
            100.0 * self.done as f64 / self.total.max(1) as f64,
            self.done,
            rate,
            self.p99_ms
        )
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self;
        writeln!(
            f,
            "engine   {:>12.0} msgs/s  ({} msgs in {:.2} s, {} shards, mean batch {:.0})",
            r.msgs_per_sec, r.params.messages, r.elapsed_s, r.shards, r.mean_batch
        )?;
        writeln!(
            f,
            "acks     p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            r.p50_ack_ms, r.p99_ack_ms, r.max_ack_ms
        )?;
        writeln!(
            f,
            "outcomes processed {}  duplicate {}  quarantined {}  verified {}",
            r.processed, r.duplicates, r.quarantined, r.verified
        )?;
        writeln!(f, "batches  longest {:.1} ms plain, {:.1} ms with sealing/merging ({} seals, {} merges); longest commit {:.1} ms", r.max_batch_ms_plain, r.max_batch_ms_with_maintenance, r.seals, r.merges, r.max_commit_ms)?;
        writeln!(
            f,
            "cpu      {:.2} core-µs/msg (user + system); threads ran {:.1} s and waited {:.1} s for a core (held by its other threads or other work)",
            r.cpu_us_per_msg, r.threads_running_s, r.threads_waiting_s
        )?;
        if r.probed_keys + r.unprobed_keys > 0 {
            writeln!(
                f,
                "probes   {} new keys asked of the other shards, {} ruled out by their published claims",
                r.probed_keys, r.unprobed_keys
            )?;
        }
        writeln!(
            f,
            "memory   {:.2} B/key RSS beyond the empty engine's {:.1} MiB ({:.2} B/key once freed memory is returned; max RSS {:.1} MiB); engine's own count: {:.2} B/key in indexes, {:.2} B/key in filters; {} keys",
            r.rss_bytes_per_key,
            r.rss_base_bytes as f64 / 1048576.0,
            r.rss_collected_bytes_per_key,
            r.rss_max_bytes as f64 / 1048576.0,
            r.index_bytes_per_key,
            r.filter_bytes_per_key,
            r.stored_keys
        )?;
        writeln!(
            f,
            "disk     {:.1} MiB allocated ({:.1} B/key); files {:.1} MiB long ({:.1} B/key)",
            r.disk_allocated_bytes as f64 / 1048576.0,
            r.disk_allocated_bytes_per_key,
            r.disk_bytes as f64 / 1048576.0,
            r.disk_bytes_per_key
        )?;
        writeln!(
            f,
            "filters  {} probes, false-positive rate {:.5}%",
            r.filter_probes,
            100.0 * r.filter_false_positive_rate
        )?;
        if let Some(h) = &r.params.handler {
            writeln!(
                f,
                "handler  {} ({} state entries, {} dead-lettered)",
                h.display(),
                r.state_entries,
                r.dead_lettered
            )?;
        }
        if r.naive_messages > 0 {
            writeln!(
                f,
                "naive    {:>12.0} msgs/s  ({} msgs, batch {})  engine/naive = {:.1}x",
                r.naive_msgs_per_sec, r.naive_messages, r.naive_batch, r.engine_over_naive
            )?;
        }
        Ok(())
    }
}
