//! A new message's handler call and what its result decides: the call against the batch's
//! view of the subscriber's state, the circuit breaker around it, and the claim, retry or
//! dead letter that follows.

use super::breaker::Transition;
use super::tally::Tally;
use super::*;
use crate::ledger::changelog::Change;

impl Shard {
    /// Runs the subscriber's handler (if it has one) on a new message against the batch's
    /// view of its state. Returns the handler version that processed it (0 without a
    /// handler), or its failure; the effects stay in the view until `write_batch`.
    pub(super) fn call_handler(
        &mut self,
        idx: usize,
        job: &Job,
    ) -> Result<Result<u64, Failure>, LedgerError> {
        let st = self.subs[idx]
            .as_mut()
            .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))?;
        let Some(h) = st.handling.handler.as_mut() else {
            return Ok(Ok(0));
        };
        let mut view = match st.handling.view.take() {
            Some(v) => v,
            None => Box::new(
                BatchView::open(&self.db, &st.name, &st.handling.state_buf)
                    .map_err(|e| storage(&self.ctx.path, e))?,
            ),
        };
        // Reuses the previous message's buffers.
        let msg = &mut self.handler_msg;
        msg.subscriber.clear();
        msg.subscriber.push_str(&st.name);
        msg.id.clear();
        msg.id.push_str(&job.id);
        msg.key_hash = job.key;
        msg.key.clone_from(&job.partition_key);
        msg.headers.clone_from(&job.headers);
        msg.payload.clear();
        msg.payload.extend_from_slice(&job.payload);
        msg.attempt = job.attempt;
        msg.received_at_ms = job.received_at_ms;
        view.set_scope(job.entity.as_deref());
        let called = Instant::now();
        let (mut view, result) = h.instance.handle(msg, view);
        let version = h.factory.version();
        let returned = Instant::now();
        self.shares
            .record_call(idx, returned.saturating_duration_since(called), returned);
        let keep = st.changelog.sink.is_some();
        let handled = result.map(|mut effects| {
            if keep {
                // Emitted messages get a record in the changelog partition of their
                // message; the relay tombstones it once they are relayed.
                let partition = job
                    .origin
                    .as_ref()
                    .and_then(crate::ledger::Origin::kafka_partition);
                for m in &mut effects.outbox {
                    m.changelog_partition = partition;
                }
                self.last_effects = Some(effects.clone());
            }
            view.absorb(effects);
            version
        });
        st.handling.view = Some(view);
        if let Err(f) = &handled {
            let kind = f.kind();
            if let (Some(i), Some(spec)) = (
                crate::ledger::HANDLER_FAILURE_KINDS
                    .iter()
                    .position(|k| *k == kind),
                self.ctx.registry.get(job.subscriber),
            ) {
                spec.counters.handler_failures[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(handled)
    }

    /// The failure a message gets without a call while its subscriber's circuit breaker is
    /// open on this shard (`breaker.rs`).
    pub(super) fn breaker_refuses(
        &mut self,
        idx: usize,
        now: u64,
        tally: &mut Tally,
    ) -> Option<Failure> {
        let st = self.subs[idx].as_ref()?;
        st.handling.handler.as_ref()?;
        let refused = st.handling.breaker.refuses(now)?;
        tally.of(idx).calls_skipped += 1;
        Some(refused)
    }

    /// Takes a call's result into the subscriber's breaker on this shard, and says when it
    /// opens or closes.
    pub(super) fn breaker_record(
        &mut self,
        idx: usize,
        handled: &Result<u64, Failure>,
        now: u64,
        tally: &mut Tally,
    ) {
        let shard = self.ctx.index;
        let Some(st) = self.subs[idx].as_mut() else {
            return;
        };
        let (threshold, cooldown_ms) = (
            st.handling.breaker_threshold,
            st.handling.breaker_cooldown_ms,
        );
        let result = handled.as_ref().map(|_| ());
        match st
            .handling
            .breaker
            .record(result, now, threshold, cooldown_ms)
        {
            Transition::Opened => {
                tally.of(idx).circuits_opened += 1;
                let last = handled.as_ref().err().map(ToString::to_string);
                tracing::warn!(shard, subscriber = %st.name, failures = st.handling.breaker.failures(),
                    cooldown_ms, last = last.as_deref().unwrap_or_default(),
                    "handler circuit opened: its messages use up attempts without a call and wait for the cool-down (dead-lettered once their attempts are used up)");
            }
            Transition::Closed => {
                tracing::info!(shard, subscriber = %st.name,
                    "handler circuit closed: a call completed after the cool-down");
            }
            Transition::None => {}
        }
    }

    /// What a handler's result decides: a claim (it commits only with the handler's
    /// effects), a retry after a backoff, or a dead letter once attempts are used up.
    pub(super) fn settle_handled(
        &mut self,
        idx: usize,
        job: &Job,
        handled: Result<u64, Failure>,
        now: u64,
        tally: &mut Tally,
    ) -> Result<Decision, LedgerError> {
        let st = self.subs[idx]
            .as_mut()
            .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))?;
        let (ttl_ms, max_attempts) = (st.claims.ttl_ms, st.handling.max_attempts);
        Ok(match handled {
            Ok(handler_version) => {
                let claim = ClaimRecord {
                    fingerprint: job.fingerprint,
                    processed_at_ms: now,
                    expires_at_ms: now.saturating_add(ttl_ms),
                    handler_version,
                };
                self.claim(idx, job, claim, now);
                let effects = self.last_effects.take();
                if let Some(st) = self.subs[idx].as_mut() {
                    if st.changelog.sink.is_some() {
                        st.changelog.changes.push(Change::new(job, claim, effects));
                    }
                }
                tally.of(idx).processed += 1;
                tally.wrote = true;
                Decision::Done(Outcome::Processed)
            }
            Err(f) if f.is_retryable() && job.attempt < max_attempts => {
                tally.of(idx).retries += 1;
                Decision::Retry(f)
            }
            Err(f) => {
                let reason = format!("{f} (attempt {} of {max_attempts})", job.attempt);
                self.dead_rows
                    .push(records::dead_letter(st, job, &f, &reason, now));
                st.records.dead_lettered += 1;
                tally.of(idx).dead_lettered += 1;
                tally.wrote = true;
                Decision::Done(Outcome::DeadLettered {
                    reason,
                    attempts: job.attempt,
                })
            }
        })
    }
}

/// How long a message whose handler failed waits before attempt `attempt + 1`: the
/// subscriber's backoff doubled per attempt, never more than its `max_backoff`, so a
/// message held in memory (and holding its source's offset) is retried within bounded
/// time.
pub(super) fn retry_delay(backoff: Duration, max_backoff: Duration, attempt: u32) -> Duration {
    let doublings = attempt.saturating_sub(1).min(16);
    backoff.saturating_mul(1 << doublings).min(max_backoff)
}

#[cfg(test)]
mod retry_tests {
    use super::retry_delay;
    use std::time::Duration;

    const MS: Duration = Duration::from_millis(1);
    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    pub(super) fn max_backoff_obeyed_while_the_backoff_doubles() {
        assert_eq!(retry_delay(50 * MS, MINUTE, 1), 50 * MS);
        assert_eq!(retry_delay(50 * MS, MINUTE, 2), 100 * MS);
        assert_eq!(retry_delay(50 * MS, MINUTE, 11), 51_200 * MS);
        assert_eq!(retry_delay(MINUTE, MINUTE, 1), MINUTE);
    }

    #[test]
    pub(super) fn max_backoff_violated_is_cut_to_it() {
        // Doubling alone: 102.4 s here, and 10 min * 2^16 (about 455 days) at most.
        assert_eq!(retry_delay(50 * MS, MINUTE, 12), MINUTE);
        let hour = Duration::from_secs(3600);
        assert_eq!(retry_delay(Duration::from_secs(600), hour, 17), hour);
        assert_eq!(retry_delay(50 * MS, MINUTE, u32::MAX), MINUTE);
    }
}
