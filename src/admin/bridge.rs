//! The bridge between async HTTP handlers and the shard threads.
//!
//! Requests hand their [`Job`] to a collector task on the async runtime, which passes
//! everything queued since it last ran, as one batch, to a submitter thread; that thread
//! groups jobs by shard and calls [`Ledger::submit`] (which blocks under backpressure, so it
//! never runs on the async runtime). Collecting on the runtime costs no thread wake-up per
//! request; grouping turns many concurrent requests into few submissions.
//!
//! Every job carries the same ack channel; a dispatcher thread takes durable outcomes off
//! it and completes each request's oneshot by sequence number. A request answers only
//! after its outcome arrived, i.e. after the commit (G1).
//!
//! The same `(subscriber, key)` is "in flight" from submission until its outcome arrives,
//! even when the client hung up meanwhile; a second request for it gets 409, or, when it
//! sends `Prefer: wait=N`, waits up to N seconds for the first to be decided and is then
//! decided itself (a duplicate of a processed first request: the same response, replayed).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crossbeam_channel::{unbounded, Receiver, Sender};
use tokio::sync::{oneshot, Notify};

use crate::ledger::{AckSender, Done, Job, Ledger, Outcome, SubscriberId};

/// A request waiting for its outcome, and the in-flight key it holds.
struct Waiter {
    reply: oneshot::Sender<Outcome>,
    key: Option<(SubscriberId, u128)>,
}

#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    /// Keys in flight, each with what wakes the requests waiting for it to be released
    /// (`Prefer: wait`). A waiter is held in its own future (`Notify`'s list is intrusive),
    /// so a request that stopped waiting leaves nothing behind: the map holds one entry
    /// per key in flight however many requests wait or waited for it.
    in_flight: HashMap<(SubscriberId, u128), Arc<Notify>>,
}

impl Pending {
    /// Releases `key` and wakes the requests waiting for it.
    fn release(&mut self, key: &(SubscriberId, u128)) {
        if let Some(n) = self.in_flight.remove(key) {
            n.notify_waiters();
        }
    }
}

/// Why a job could not be started.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum StartError {
    /// The same key of the same subscriber is still being processed.
    InFlight,
    /// The submitter stopped (shutting down).
    Stopped,
}

/// Submits jobs and delivers their durable outcomes to async callers.
pub(crate) struct Ingest {
    ledger: Arc<Ledger>,
    next_seq: AtomicU64,
    pending: Arc<Mutex<Pending>>,
    ack: AckSender,
    jobs: Sender<Vec<(usize, Job)>>,
    /// Started on first use, on the runtime that serves the requests.
    collector: OnceLock<tokio::sync::mpsc::UnboundedSender<(usize, Job)>>,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest")
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

impl Ingest {
    pub(crate) fn start(ledger: Arc<Ledger>) -> std::io::Result<Ingest> {
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (ack, acks) = unbounded::<Vec<Done>>();
        let (jobs, queue) = unbounded::<Vec<(usize, Job)>>();
        {
            let pending = pending.clone();
            std::thread::Builder::new()
                .name("dedupd-http-acks".into())
                .spawn(move || dispatch(acks, pending))?;
        }
        // Threads end on their own when the channels close; the submitter holds the
        // ledger weakly so closing the ledger never waits for it.
        {
            let ledger = Arc::downgrade(&ledger);
            let pending = pending.clone();
            std::thread::Builder::new()
                .name("dedupd-http-submit".into())
                .spawn(move || submit(queue, ledger, pending))?;
        }
        Ok(Ingest {
            ledger,
            next_seq: AtomicU64::new(1),
            pending,
            ack,
            jobs,
            collector: OnceLock::new(),
        })
    }

    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// A fresh sequence number and the receiver its outcome will arrive on. `key` marks
    /// `(subscriber, key)` in flight until then.
    pub(crate) fn register(
        &self,
        key: Option<(SubscriberId, u128)>,
    ) -> Result<(u64, oneshot::Receiver<Outcome>), StartError> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = key {
            if p.in_flight.contains_key(&k) {
                return Err(StartError::InFlight);
            }
            p.in_flight.insert(k, Arc::new(Notify::new()));
        }
        p.waiters.insert(seq, Waiter { reply: tx, key });
        Ok((seq, rx))
    }

    /// Forgets a registration whose job never reached a shard.
    pub(crate) fn unregister(&self, seq: u64) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = p.waiters.remove(&seq) {
            if let Some(k) = w.key {
                p.release(&k);
            }
        }
    }

    /// Resolves when `key` is no longer in flight (at once if it is not now). A request
    /// that found its key in flight and prefers to wait registers again after this.
    pub(crate) async fn released(&self, key: (SubscriberId, u128)) {
        let notify = {
            let p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            match p.in_flight.get(&key) {
                Some(n) => n.clone(),
                None => return,
            }
        };
        let released = notify.notified();
        tokio::pin!(released);
        // Registered before the key is looked at again: a release in between is not lost
        // (`notify_waiters` wakes every `Notified` that is enabled).
        released.as_mut().enable();
        if !self.still_in_flight(key, &notify) {
            return;
        }
        released.await;
    }

    /// Whether `key` is still held by the registration `notify` belongs to.
    fn still_in_flight(&self, key: (SubscriberId, u128), notify: &Arc<Notify>) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_flight
            .get(&key)
            .is_some_and(|n| Arc::ptr_eq(n, notify))
    }

    /// Keys in flight, and requests waiting for one of them right now (`Prefer: wait`):
    /// a waiter holds memory only while it waits.
    pub(crate) fn in_flight(&self) -> (usize, usize) {
        let p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = p.in_flight.values().map(|n| Arc::strong_count(n) - 1).sum();
        (p.in_flight.len(), waiting)
    }

    /// Where shards send outcomes for registered sequence numbers.
    pub(crate) fn ack_sender(&self) -> AckSender {
        self.ack.clone()
    }

    /// Hands a registered job to the submitter; never blocks.
    pub(crate) fn send(&self, shard: usize, job: Job) -> Result<(), StartError> {
        let seq = job.seq;
        let sent = match tokio::runtime::Handle::try_current() {
            Ok(rt) => self
                .collector
                .get_or_init(|| {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    rt.spawn(collect(rx, self.jobs.clone()));
                    tx
                })
                .send((shard, job))
                .is_ok(),
            Err(_) => self.jobs.send(vec![(shard, job)]).is_ok(),
        };
        if sent {
            Ok(())
        } else {
            self.unregister(seq);
            Err(StartError::Stopped)
        }
    }

    /// Requests waiting for an outcome right now.
    pub(crate) fn waiting(&self) -> usize {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiters
            .len()
    }
}

fn complete(pending: &Mutex<Pending>, seq: u64, outcome: Outcome) {
    let waiter = {
        let mut p = pending.lock().unwrap_or_else(|p| p.into_inner());
        let w = p.waiters.remove(&seq);
        if let Some(k) = w.as_ref().and_then(|w| w.key) {
            p.release(&k);
        }
        w
    };
    if let Some(w) = waiter {
        // The client may have gone; its outcome is durable all the same.
        let _ = w.reply.send(outcome);
    }
}

fn dispatch(acks: Receiver<Vec<Done>>, pending: Arc<Mutex<Pending>>) {
    for batch in acks {
        for done in batch {
            complete(&pending, done.seq, done.outcome);
        }
    }
}

/// Everything queued since the last poll, as one batch for the submitter.
async fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(usize, Job)>,
    jobs: Sender<Vec<(usize, Job)>>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(j) => batch.push(j),
                Err(_) => break,
            }
        }
        if jobs.send(batch).is_err() {
            return;
        }
    }
}

fn submit(queue: Receiver<Vec<(usize, Job)>>, ledger: Weak<Ledger>, pending: Arc<Mutex<Pending>>) {
    let mut staged: Vec<Vec<Job>> = Vec::new();
    while let Ok(first) = queue.recv() {
        let Some(ledger) = ledger.upgrade() else {
            return;
        };
        let shards = ledger.shard_count();
        staged.resize_with(shards, Vec::new);
        // Everything queued meanwhile goes in the same submissions (bounded, so one
        // shard's backpressure does not hold the others' jobs for long).
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(batch) = next {
            for (shard, job) in batch {
                staged[shard % shards].push(job);
                taken += 1;
            }
            next = if taken < 8192 {
                queue.try_recv().ok()
            } else {
                None
            };
        }
        for (shard, jobs) in staged.iter_mut().enumerate() {
            if jobs.is_empty() {
                continue;
            }
            let batch = std::mem::take(jobs);
            let seqs: Vec<u64> = batch.iter().map(|j| j.seq).collect();
            if let Err(e) = ledger.submit(shard, batch) {
                for seq in seqs {
                    complete(
                        &pending,
                        seq,
                        Outcome::Failed {
                            reason: e.to_string(),
                        },
                    );
                }
            }
        }
    }
}
