//! Pipe mode: JSON lines in, one outcome line out per input line, in input order, each
//! printed only after its outcome is durable (G1).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::Arc;

use crossbeam_channel::{bounded, select, unbounded, Receiver};
use serde::Serialize;

use crate::config::Config;
use crate::envelope::{canonical_payload, derive_entity, derive_key, fingerprint, Envelope};
use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome};

use super::Sequencer;

/// Lines in flight (read, not yet printed) before reading pauses.
const WINDOW: usize = 65_536;
/// Jobs per submission to one shard.
const CHUNK: usize = 512;

/// Why pipe mode stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipeError {
    #[error("reading input failed: {0}")]
    Input(std::io::Error),
    #[error("writing outcomes failed: {0}")]
    Output(std::io::Error),
    #[error("{0}")]
    Ledger(#[from] LedgerError),
}

/// Counts of the outcomes printed.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct PipeSummary {
    pub lines: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub quarantined: u64,
    pub dead_lettered: u64,
    pub rejected: u64,
}

#[derive(Serialize)]
struct OutcomeLine<'a> {
    seq: u64,
    subscriber: Option<&'a str>,
    id: Option<&'a str>,
    outcome: &'a str,
    reason: Option<String>,
}

/// What the printer needs to know of a line besides its outcome.
struct LineMeta {
    subscriber: Option<Arc<str>>,
    id: Option<String>,
}

/// A job and the shard that decides it.
struct Routed {
    job: Job,
    shard: usize,
}

enum Event {
    Line(u64, LineMeta),
    Eof(u64),
}

/// Runs pipe mode until `input` ends and every outcome is printed, or until the ledger
/// fails (then the lines after the failure are never printed: nothing is acked on a guess).
pub fn run_pipe(
    ledger: &Ledger,
    config: &Config,
    input: impl Read,
    output: impl Write + Send,
) -> Result<PipeSummary, PipeError> {
    let input = BufReader::with_capacity(1 << 16, input);
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let (meta_tx, meta_rx) = bounded::<Event>(WINDOW);
    std::thread::scope(|scope| {
        let printer = scope.spawn(move || print_outcomes(meta_rx, ack_rx, output));
        let read_result = read_lines(ledger, config, input, &ack_tx, &meta_tx);
        drop(meta_tx);
        drop(ack_tx);
        let printed = printer
            .join()
            .unwrap_or_else(|_| Err(PipeError::Output(std::io::Error::other("printer panicked"))));
        read_result?;
        printed
    })
}

fn read_lines<R: Read>(
    ledger: &Ledger,
    config: &Config,
    mut input: BufReader<R>,
    ack: &crossbeam_channel::Sender<Vec<Done>>,
    meta: &crossbeam_channel::Sender<Event>,
) -> Result<(), PipeError> {
    let mut staged: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    let mut line = Vec::new();
    let mut seq = 0u64;
    let flush = |staged: &mut Vec<Vec<Job>>| -> Result<(), PipeError> {
        for (shard, jobs) in staged.iter_mut().enumerate() {
            if !jobs.is_empty() {
                ledger.submit(shard, std::mem::take(jobs))?;
            }
        }
        Ok(())
    };
    loop {
        line.clear();
        let n = input
            .read_until(b'\n', &mut line)
            .map_err(PipeError::Input)?;
        if n == 0 {
            break;
        }
        seq += 1;
        let text = trim_line(&line);
        let decided = decide_line(ledger, config, text, seq, ack);
        let (m, job) = match decided {
            Ok((m, job)) => (m, Some(Ok(job))),
            Err((m, reason)) => (m, Some(Err(reason))),
        };
        if meta.send(Event::Line(seq, m)).is_err() {
            // The printer stopped (output failed or the ledger failed): stop reading.
            break;
        }
        let job = match job {
            Some(Err(reason)) => {
                let _ = ack.send(vec![Done {
                    seq,
                    outcome: Outcome::Rejected { reason },
                }]);
                None
            }
            Some(Ok(j)) => Some(j),
            None => None,
        };
        if let Some(Routed { job, shard }) = job {
            staged[shard].push(job);
            if staged[shard].len() >= CHUNK {
                ledger.submit(shard, std::mem::take(&mut staged[shard]))?;
            }
        }
        // Nothing more buffered: the next read may block, so hand over what we have
        // (a consumer that waits for each outcome before sending more must get it).
        if input.buffer().is_empty() || meta.is_full() {
            flush(&mut staged)?;
        }
    }
    flush(&mut staged)?;
    let _ = meta.send(Event::Eof(seq));
    Ok(())
}

fn trim_line(line: &[u8]) -> &[u8] {
    let mut end = line.len();
    while end > 0 && (line[end - 1] == b'\n' || line[end - 1] == b'\r') {
        end -= 1;
    }
    &line[..end]
}

/// Parses one line into a job, or says why it is rejected.
#[allow(clippy::result_large_err)]
fn decide_line(
    ledger: &Ledger,
    config: &Config,
    text: &[u8],
    seq: u64,
    ack: &crossbeam_channel::Sender<Vec<Done>>,
) -> Result<(LineMeta, Routed), (LineMeta, String)> {
    let none = || LineMeta {
        subscriber: None,
        id: None,
    };
    if text.iter().all(|b| b.is_ascii_whitespace()) {
        return Err((none(), "empty line".into()));
    }
    let env: Envelope = match serde_json::from_slice(text) {
        Ok(e) => e,
        Err(e) => return Err((none(), format!("malformed JSON: {e}"))),
    };
    let sub_name = env
        .subscriber
        .clone()
        .unwrap_or_else(|| config.default_subscriber.clone());
    let sub = match ledger.subscriber(&sub_name) {
        Ok(s) => s,
        Err(e) => {
            return Err((
                LineMeta {
                    subscriber: None,
                    id: env.id.clone(),
                },
                e.to_string(),
            ))
        }
    };
    let canonical = canonical_payload(&env.payload);
    let key = match derive_key(&env, &canonical, &sub.settings()) {
        Ok(k) => k,
        Err(e) => {
            let id = env.id.as_ref().map(|s| {
                // Never echo a huge id back; the reason already says how long it was.
                s.chars().take(128).collect::<String>()
            });
            return Err((
                LineMeta {
                    subscriber: Some(sub.name.clone()),
                    id,
                },
                e.to_string(),
            ));
        }
    };
    let entity = match derive_entity(&env, &sub.settings()) {
        Ok(r) => r,
        Err(e) => {
            return Err((
                LineMeta {
                    subscriber: Some(sub.name.clone()),
                    id: Some(key.text),
                },
                e.to_string(),
            ))
        }
    };
    let mut job = Job::new(
        seq,
        sub.id,
        key.hash,
        fingerprint(&canonical),
        &key.text,
        &canonical,
        ack.clone(),
    );
    job.headers = env.headers.into_iter().collect();
    job.partition_key = env.key;
    let shard = ledger.place(&sub, &mut job, entity);
    Ok((
        LineMeta {
            subscriber: Some(sub.name.clone()),
            id: Some(key.text),
        },
        Routed { job, shard },
    ))
}

fn print_outcomes(
    meta_rx: Receiver<Event>,
    ack_rx: Receiver<Vec<Done>>,
    output: impl Write,
) -> Result<PipeSummary, PipeError> {
    let mut out = std::io::BufWriter::with_capacity(1 << 16, output);
    let mut metas: HashMap<u64, LineMeta> = HashMap::new();
    let mut order: Sequencer<Outcome> = Sequencer::starting_at(1);
    let mut total: Option<u64> = None;
    let mut summary = PipeSummary::default();
    let mut buf = Vec::with_capacity(256);
    // A closed channel is swapped for one that never delivers, so `select!` keeps serving
    // the other until both are done.
    let (mut meta_rx, mut ack_rx) = (meta_rx, ack_rx);
    let (mut meta_open, mut ack_open) = (true, true);
    loop {
        if total == Some(order.watermark() - 1) || (!meta_open && !ack_open) {
            break;
        }
        select! {
            recv(meta_rx) -> ev => match ev {
                Ok(Event::Line(seq, m)) => { metas.insert(seq, m); }
                Ok(Event::Eof(n)) => total = Some(n),
                Err(_) => { meta_open = false; meta_rx = crossbeam_channel::never(); }
            },
            recv(ack_rx) -> done => match done {
                Ok(v) => for d in v { order.insert(d.seq, d.outcome); },
                Err(_) => { ack_open = false; ack_rx = crossbeam_channel::never(); }
            },
        }
        // A line is printed once both its outcome and what it names have arrived.
        while order
            .next_ready()
            .is_some_and(|seq| metas.contains_key(&seq))
        {
            let Some((seq, outcome)) = order.pop_ready() else {
                break;
            };
            if let Outcome::Failed { reason } = &outcome {
                out.flush().map_err(PipeError::Output)?;
                return Err(PipeError::Ledger(LedgerError::Poisoned(reason.clone())));
            }
            let m = metas.remove(&seq).unwrap_or(LineMeta {
                subscriber: None,
                id: None,
            });
            match &outcome {
                Outcome::Processed => summary.processed += 1,
                Outcome::Duplicate => summary.duplicate += 1,
                Outcome::Quarantined { .. } => summary.quarantined += 1,
                Outcome::DeadLettered { .. } => summary.dead_lettered += 1,
                Outcome::Rejected { .. } | Outcome::Failed { .. } => summary.rejected += 1,
            }
            summary.lines += 1;
            buf.clear();
            let line = OutcomeLine {
                seq,
                subscriber: m.subscriber.as_deref(),
                id: m.id.as_deref(),
                outcome: outcome.name(),
                reason: outcome.reason(),
            };
            serde_json::to_writer(&mut buf, &line)
                .map_err(|e| PipeError::Output(std::io::Error::other(e)))?;
            buf.push(b'\n');
            out.write_all(&buf).map_err(PipeError::Output)?;
        }
        if ack_rx.is_empty() {
            out.flush().map_err(PipeError::Output)?;
        }
    }
    out.flush().map_err(PipeError::Output)?;
    if total != Some(order.watermark() - 1) {
        // Every channel closed with lines undecided: a shard writer is gone (G7). The
        // lines that were printed are durable; the rest must not read as a clean end.
        return Err(PipeError::Ledger(LedgerError::Poisoned(format!(
            "no outcome arrived for line {} and later ones: a shard writer stopped",
            order.watermark()
        ))));
    }
    Ok(summary)
}
