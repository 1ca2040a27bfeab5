//! The writer thread of a shard: its loop (gather a batch, decide and commit it, send the
//! outcomes in order, schedule retries), what it does between batches (peers, control
//! requests, maintenance in the gaps), and the thread's start with its fail-stop (I4).

use super::*;

impl Shard {
    /// Answers every probe and takes every reply already queued (between batches, so only
    /// committed claims are reported).
    pub(super) fn serve_peers(&mut self, peer_rx: &Receiver<PeerMsg>) {
        while let Ok(m) = peer_rx.try_recv() {
            self.peer(m);
        }
    }

    /// The writer loop: takes a batch (everything queued since the last commit), decides
    /// and commits it, sends its outcomes, schedules retries, answers peers and control
    /// requests between batches, and keeps maintenance in the gaps. Returns when told to
    /// stop or when every sender is gone.
    pub(crate) fn run(mut self, rx: Receiver<ShardMsg>, peer_rx: Receiver<PeerMsg>) {
        let tick = Duration::from_millis(50);
        loop {
            // Peers first: a probe waiting behind a batch of ours holds the asking shard's
            // messages for a whole batch and fsync (I6).
            self.serve_peers(&peer_rx);
            let mut wait = match self.retries.peek() {
                Some(r) => r.due.saturating_duration_since(Instant::now()).min(tick),
                None => tick,
            };
            if self.shares.has_deferred() {
                wait = wait.min(share::RECHECK);
            }

            let msg = crossbeam_channel::select! {
                recv(rx) -> m => match m {
                    Ok(m) => Some(m),
                    Err(_) => break,
                },
                recv(peer_rx) -> m => {
                    if let Ok(m) = m {
                        self.peer(m);
                    }
                    None
                },
                default(wait) => {
                    self.take_due_retries();
                    if self.batch.is_empty() && !self.shares.has_deferred() {
                        self.idle();
                    } else {
                        self.process_batch();
                    }
                    continue;
                }
            };
            let deferred = match msg {
                Some(ShardMsg::Jobs(jobs)) => {
                    self.take_due_retries();
                    self.batch.extend(jobs);
                    let deferred = self.gather(&rx, &peer_rx);
                    self.serve_peers(&peer_rx);
                    self.process_batch();
                    if deferred.is_none() {
                        self.gap_maintenance(&rx, &peer_rx);
                    }
                    deferred
                }
                // Answers completed a probe: decide those jobs with whatever else is queued.
                None if !self.batch.is_empty() => {
                    let deferred = self.gather(&rx, &peer_rx);
                    self.serve_peers(&peer_rx);
                    self.process_batch();
                    deferred
                }
                None => None,
                other => other,
            };
            match deferred {
                Some(ShardMsg::Control(c)) => self.control(c),
                Some(ShardMsg::Stop) => break,
                Some(ShardMsg::Jobs(_)) | None => {}
            }
        }
        self.ctx.inflight.release_all(self.ctx.index);
    }

    /// Adds jobs queued since the batch started (group commit), up to `max_batch`; while
    /// the batch is small ([`LINGER_BELOW`] jobs) it also waits up to `ledger.max_linger`
    /// for more, as long as they keep coming (a pause of half of it ends the wait).
    /// Returns a non-job message that arrived meanwhile, to run after the batch.
    ///
    /// A commit costs about the same whatever its size (~0.35 ms of CPU: ~15 page writes,
    /// their checksums and an fsync, measured at 37 jobs a batch): at half of the capacity
    /// the batches were 30-50 jobs and commits took a fifth of the CPU (5 of 22 core-µs a
    /// message). Lingering 1 ms made them 83-99 jobs and the run 0.82-0.88x the CPU, with
    /// the p99 inside the noise of this machine; at full load batches are ~950 jobs and
    /// it measured 0.93 and 0.98x the messages per second (a full in-flight window sends
    /// nothing until acks come, so a small batch then waits out the pause for nothing): so
    /// the default is 0 (`docs/bench-history.md`, 2026-12-07). A bigger batch pays its
    /// commit already, and a source that sends one message and waits for its answer sends
    /// nothing more: the pause ends the wait for it after half of `max_linger`.
    ///
    /// Peers are answered while it waits (the previous batch has committed and this one is
    /// not decided yet): a probe must not wait for this shard's linger.
    pub(super) fn gather(
        &mut self,
        rx: &Receiver<ShardMsg>,
        peer_rx: &Receiver<PeerMsg>,
    ) -> Option<ShardMsg> {
        let max_batch = self.ctx.config.max_batch.get();
        let linger = self.ctx.config.max_linger;
        let deadline = Instant::now() + linger;
        while self.batch.len() < max_batch {
            let next = if linger.is_zero() || self.batch.len() >= LINGER_BELOW {
                rx.try_recv().map_err(|e| matches!(e, TryRecvError::Empty))
            } else {
                let until = deadline.min(Instant::now() + linger / 2);
                crossbeam_channel::select! {
                    recv(rx) -> m => m.map_err(|_| true),
                    recv(peer_rx) -> m => match m {
                        Ok(m) => {
                            self.peer(m);
                            continue;
                        }
                        // Shards are stopping: commit what is here.
                        Err(_) => Err(true),
                    },
                    default(until.saturating_duration_since(Instant::now())) => Err(true),
                }
            };
            match next {
                Ok(ShardMsg::Jobs(more)) => self.batch.extend(more),
                Ok(other) => return Some(other),
                Err(_) => break,
            }
        }
        None
    }

    pub(super) fn poison(&mut self, e: LedgerError) {
        tracing::error!(shard = self.ctx.index, error = %e, "the shard stops acknowledging");
        self.ctx.poison.set(e.to_string());
        self.failed = Some(e);
    }

    /// Decides and commits the gathered batch, then sends its outcomes, schedules its
    /// retries and sends its probes. After a failed commit every waiting job fails (I4).
    pub(super) fn process_batch(&mut self) {
        let started = Instant::now();
        let mut jobs = std::mem::take(&mut self.batch);
        self.shares.begin_batch(&mut jobs, started);
        if jobs.is_empty() {
            // Only set-aside messages, all still over their share.
            self.batch = jobs;
            self.idle();
            return;
        }
        let now = self.ctx.clock.now_ms();
        for job in jobs.iter_mut().filter(|j| j.received_at_ms == 0) {
            job.received_at_ms = now;
        }
        if self.failed.is_none() && self.ctx.poison.is_set() {
            // Another shard failed: the whole ledger stops acknowledging (G7).
            let reason = self.ctx.poison.reason().unwrap_or_default();
            self.failed = Some(LedgerError::Poisoned(reason));
        }
        let (decisions, maintenance) = match &self.failed {
            Some(e) => (Err(e.clone()), false),
            None => match self.commit_batch_catching_panics(&jobs, now) {
                Ok((d, m)) => (Ok(d), m),
                Err(e) => {
                    self.abandon_batch();
                    self.poison(e.clone());
                    (Err(e), false)
                }
            },
        };
        let elapsed = started.elapsed().as_micros() as u64;
        let count = jobs.len() as u64;
        // Committed (or failed, and the shard stops): the keys decided without a probe
        // go back to the in-flight set.
        // Counted before the outcomes go out, so whoever saw every outcome sees the count.
        let unprobed = self.held_unprobed.len() as u64;
        if unprobed > 0 {
            self.ctx
                .metrics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .unprobed_keys += unprobed;
        }
        self.ctx
            .inflight
            .release(self.held_unprobed.drain(..), self.ctx.index);
        match decisions {
            Ok(decisions) => self.follow_decisions(&mut jobs, decisions),
            Err(e) => self.fail_all(&mut jobs, &e),
        }
        metrics::histogram!(crate::telemetry::metric::BATCH_DURATION_SECONDS, "shard" => self.ctx.index.to_string())
            .record(elapsed as f64 / 1e6);
        {
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.batches += 1;
            m.messages += count;
            if maintenance {
                m.max_batch_us_maintenance = m.max_batch_us_maintenance.max(elapsed);
            } else {
                m.max_batch_us_plain = m.max_batch_us_plain.max(elapsed);
            }
        }
        self.batch = jobs;
    }

    /// Acts on a committed batch's decisions: outcomes to their sources, failed handler
    /// calls and jobs waiting for their key to the retry queue, probes to the other shards.
    pub(super) fn follow_decisions(&mut self, jobs: &mut Vec<Job>, decisions: Vec<Decision>) {
        let mut done = Vec::with_capacity(jobs.len());
        let mut probes = Vec::new();
        let mut decided_elsewhere = Vec::new();
        for (mut job, d) in jobs.drain(..).zip(decisions) {
            // The batch that used the other shards' answer committed: give the key
            // back (a retried job asks again next time).
            if job.probed.take().is_some() {
                decided_elsewhere.push((job.subscriber, job.key));
            }
            match d {
                Decision::Done(outcome) => done.push((job, outcome)),
                Decision::Probe => probes.push(job),
                Decision::Wait => self.retry_after(job, WAIT_FOR_KEY),
                Decision::Defer => self.shares.defer(job),
                Decision::Retry(failure) => {
                    let delay = match &failure {
                        // Back when the breaker lets a call through again (a millisecond
                        // late rather than early: the breaker reads the ledger's clock).
                        Failure::CircuitOpen { retry_in_ms, .. } => {
                            Duration::from_millis(retry_in_ms.saturating_add(1))
                        }
                        _ => self.subs[job.subscriber.0 as usize].as_ref().map_or(
                            Duration::from_millis(50),
                            |s| {
                                handle::retry_delay(
                                    s.handling.retry_backoff,
                                    s.handling.max_backoff,
                                    job.attempt,
                                )
                            },
                        ),
                    };
                    tracing::debug!(shard = self.ctx.index, id = %job.id, attempt = job.attempt,
                        error = %failure, "handler failed; retrying after {delay:?}");
                    job.attempt += 1;
                    self.retry_after(job, delay);
                }
            }
        }
        self.ctx.inflight.release(decided_elsewhere, self.ctx.index);
        self.count_acks(&done);
        send_outcomes(done);
        self.send_probes(probes);
    }

    /// Adds the decided jobs' latencies to their subscribers' counters, one atomic add
    /// per subscriber and batch.
    pub(super) fn count_acks(&self, done: &[(Job, Outcome)]) {
        let mut per_sub: Vec<(SubscriberId, u64, u64)> = Vec::new();
        let now = Instant::now();
        for (job, _) in done {
            let us = now.saturating_duration_since(job.created).as_micros() as u64;
            match per_sub.iter_mut().find(|(s, _, _)| *s == job.subscriber) {
                Some((_, n, sum)) => {
                    *n += 1;
                    *sum += us;
                }
                None => per_sub.push((job.subscriber, 1, us)),
            }
        }
        for (sub, n, sum) in per_sub {
            if let Some(spec) = self.ctx.registry.get(sub) {
                spec.counters.acked.fetch_add(n, Ordering::Relaxed);
                spec.counters
                    .ack_latency_us
                    .fetch_add(sum, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn retry_after(&mut self, job: Job, delay: Duration) {
        self.retry_order += 1;
        self.retries.push(Retry {
            due: Instant::now() + delay,
            order: self.retry_order,
            job,
        });
    }

    /// After a failed batch (or on a failed shard): the batch's jobs, jobs waiting for
    /// probe answers and jobs waiting for a retry all fail, since none will be decided.
    pub(super) fn fail_all(&mut self, jobs: &mut Vec<Job>, e: &LedgerError) {
        let reason = e.to_string();
        self.ctx.inflight.release_all(self.ctx.index);
        let waiting: Vec<Job> = self.probing.drain().flat_map(|(_, g)| g.jobs).collect();
        let retrying: Vec<Job> = self
            .retries
            .drain()
            .map(|r| r.job)
            .chain(self.shares.take_deferred())
            .collect();
        let failed = |j| {
            (
                j,
                Outcome::Failed {
                    reason: reason.clone(),
                },
            )
        };
        let done = waiting
            .into_iter()
            .map(failed)
            .chain(jobs.drain(..).map(failed))
            .chain(retrying.into_iter().map(failed))
            .collect();
        send_outcomes(done);
    }
    /// [`Shard::commit_batch`], with a panic (a native handler's bug, say) turned into an
    /// error. The unwinding dropped the batch's transaction uncommitted, so nothing of the
    /// batch is durable; the caller stops the shard as after a storage error (I4).
    pub(super) fn commit_batch_catching_panics(
        &mut self,
        jobs: &[Job],
        now: u64,
    ) -> Result<(Vec<Decision>, bool), LedgerError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.commit_batch(jobs, now)
        }))
        .unwrap_or_else(|panic| {
            Err(LedgerError::Panicked {
                path: self.ctx.path.clone(),
                detail: crate::ledger::panic_message(&*panic),
            })
        })
    }

    /// Moves retries whose backoff has passed into the current batch.
    pub(super) fn take_due_retries(&mut self) {
        let now = Instant::now();
        while self.retries.peek().is_some_and(|r| r.due <= now) {
            if let Some(r) = self.retries.pop() {
                self.batch.push(r.job);
            }
        }
    }

    /// After a failed commit the in-memory state may hold claims that never became durable;
    /// nothing will be decided against it again (I4), so only scratch buffers are cleared.
    pub(super) fn abandon_batch(&mut self) {
        self.quarantine_rows.clear();
        self.dead_rows.clear();
        self.settled.clear();
        for st in self.subs.iter_mut().flatten() {
            LogRow::start(&mut st.claims.pending_log);
            st.handling.view = None;
            if let Some(copies) = st.changelog.record_copies.as_mut() {
                copies.clear();
            }
        }
    }
}

/// Starts a shard's writer thread: it opens the shard (reporting the result on `ready`),
/// then runs the writer loop until stopped. A panic while opening is reported as a
/// corrupt file; one in the loop outside a batch stops the whole ledger (I4), so no dead
/// shard hides behind a ledger that reads as ready.
pub(crate) fn spawn(
    ctx: ShardContext,
    rx: Receiver<ShardMsg>,
    peer_rx: Receiver<PeerMsg>,
    ready_tx: Sender<Result<Arc<Database>, LedgerError>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let index = ctx.index;
    std::thread::Builder::new()
        .name(format!("dedupd-shard-{index}"))
        .spawn(move || {
            let path = ctx.path.clone();
            let poison = ctx.poison.clone();
            // redb may panic on a file damaged outside it (when `verify_on_open`
            // is off); that is corruption to report, not a crash.
            let opened =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Shard::open(ctx)))
                    .unwrap_or_else(|panic| {
                        Err(LedgerError::Corrupt {
                            path: path.clone(),
                            detail: crate::ledger::panic_message(&*panic),
                        })
                    });
            match opened {
                Ok(shard) => {
                    // Readers (record pages) open their own read transactions on it,
                    // off the writer thread.
                    let _ = ready_tx.send(Ok(shard.db.clone()));
                    // A batch catches its own panics (`Shard::process_batch`); one
                    // anywhere else in the loop must stop the ledger too (I4), not
                    // leave a dead shard behind a ledger that reads as ready.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        shard.run(rx, peer_rx)
                    }));
                    if let Err(panic) = ran {
                        let e = LedgerError::Panicked {
                            path,
                            detail: crate::ledger::panic_message(&*panic),
                        };
                        tracing::error!(shard = index, error = %e, "the shard stopped");
                        poison.set(e.to_string());
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
}

/// Sends each job's outcome to its source, grouped per source channel.
pub(super) fn send_outcomes(done: Vec<(Job, Outcome)>) {
    let mut groups: Vec<(crate::ledger::AckSender, Vec<Done>)> = Vec::new();
    for (job, outcome) in done {
        let d = Done {
            seq: job.seq,
            outcome,
        };
        match groups.iter_mut().find(|(tx, _)| tx.same_channel(&job.ack)) {
            Some((_, v)) => v.push(d),
            None => groups.push((job.ack, vec![d])),
        }
    }
    for (tx, v) in groups {
        let _ = tx.send(v);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use crossbeam_channel::unbounded;

    use crate::clock::SystemClock;
    use crate::config::Config;
    use crate::envelope::{fingerprint, key_hash};
    use crate::ledger::{Done, Job, Ledger};

    /// One shard lingering `linger`.
    fn open(dir: &std::path::Path, linger: Duration) -> Ledger {
        let mut c = Config::default();
        c.ledger.shards = std::num::NonZeroUsize::new(1);
        c.ledger.max_linger = linger;
        Ledger::open(dir, &c, Arc::new(SystemClock)).unwrap()
    }

    /// Submits `n` new messages numbered from `from` in one chunk.
    fn submit(ledger: &Ledger, from: u64, n: u64, tx: &crossbeam_channel::Sender<Vec<Done>>) {
        let s = ledger.subscriber("s").unwrap();
        let jobs = (from..from + n)
            .map(|i| {
                let id = format!("m-{i}");
                let payload = format!("{{\"n\":{i}}}");
                let key = key_hash(id.as_bytes());
                let print = fingerprint(payload.as_bytes());
                Job::new(i, s.id, key, print, &id, payload.as_bytes(), tx.clone())
            })
            .collect();
        ledger.submit(0, jobs).unwrap();
    }

    fn await_outcomes(rx: &crossbeam_channel::Receiver<Vec<Done>>, n: usize) {
        let mut got = 0;
        while got < n {
            got += rx.recv_timeout(Duration::from_secs(30)).unwrap().len();
        }
    }

    #[test]
    fn a_small_batch_waits_for_more_while_they_come_and_stops_at_a_pause() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = open(dir.path(), Duration::from_secs(1));
        let (tx, rx) = unbounded();
        submit(&ledger, 0, 10, &tx);
        std::thread::sleep(Duration::from_millis(50));
        let second = Instant::now();
        submit(&ledger, 10, 10, &tx);
        await_outcomes(&rx, 20);
        // Both chunks in one batch: the writer waited for the second.
        assert_eq!(ledger.metrics()[0].batches, 1);
        // Nothing came after the second chunk: the wait ended half a linger (500 ms) after
        // it, not at the linger's end (950 ms after it).
        let waited = second.elapsed();
        assert!(
            waited >= Duration::from_millis(450) && waited < Duration::from_millis(850),
            "{waited:?}"
        );
        ledger.close().unwrap();
    }

    #[test]
    fn a_batch_of_linger_below_jobs_commits_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = open(dir.path(), Duration::from_secs(1));
        let (tx, rx) = unbounded();
        let started = Instant::now();
        submit(&ledger, 0, super::LINGER_BELOW as u64, &tx);
        await_outcomes(&rx, super::LINGER_BELOW);
        let took = started.elapsed();
        assert!(took < Duration::from_millis(450), "{took:?}");
        ledger.close().unwrap();
    }
}
