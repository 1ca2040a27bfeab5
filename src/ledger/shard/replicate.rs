//! A batch's side of the changelog (`changelog = true`): changes replayed from it and
//! snapshots for it decided like messages, and the batch's changes and records handed to
//! each subscriber's sink before the batch commits.

use super::decide::batch_view;
use super::tally::Tally;
use super::*;
use crate::ledger::changelog::{Change, Published, RecordCopy};

impl Shard {
    /// Replays a change from a changelog: its claim (unless it has expired) and its state
    /// effects, with no handler call and nothing published again.
    pub(super) fn restore(
        &mut self,
        idx: usize,
        job: &Job,
        change: &Change,
        now: u64,
        tally: &mut Tally,
    ) -> Result<Decision, LedgerError> {
        let claim = change.claim();
        if claim.is_live(now) {
            self.claim(idx, job, claim, now);
        }
        if change.has_effects() {
            let st = self.subs[idx]
                .as_mut()
                .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))?;
            let mut view = batch_view(st, &self.db, &self.ctx.path)?;
            view.set_scope(change.entity.as_deref());
            view.absorb(change.effects());
            st.handling.view = Some(view);
        }
        tally.wrote = true;
        Ok(Decision::Done(Outcome::Processed))
    }

    /// Reads the current value of each item a snapshot names, through the batch's view
    /// (this batch's earlier messages included), and queues the snapshot for the
    /// changelog with the batch's changes: published in batch order, it is never older
    /// than a change of the same items published before it.
    pub(super) fn snapshot(&mut self, idx: usize, items: &Change) -> Result<Decision, LedgerError> {
        let st = self.subs[idx]
            .as_mut()
            .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))?;
        if st.changelog.sink.is_none() {
            // Nothing would be published, and the caller would then drop the records the
            // snapshot stands for.
            return Ok(Decision::Done(Outcome::Failed {
                reason: format!(
                    "subscriber {:?} has no changelog to publish a snapshot to",
                    st.name
                ),
            }));
        }
        let mut view = batch_view(st, &self.db, &self.ctx.path)?;
        view.set_scope(items.entity.as_deref());
        let mut current = items.clone();
        current.snapshot = true;
        for (k, v) in current.state.iter_mut() {
            *v = view.get(k);
        }
        // Marks are never deleted: one a change wrote exists, so it is kept with no read
        // (a read of a mark in a merged run costs a block decompression).
        current.versions.retain(|k, v| match view.version(k) {
            Some(now) => {
                *v = now;
                true
            }
            None => false,
        });
        st.handling.view = Some(view);
        st.changelog.changes.push(current);
        Ok(Decision::Done(Outcome::Processed))
    }

    /// Hands each subscriber's changes of this batch to its changelog; the caller waits
    /// for them before it commits. A refusal stops the shard before anything of the batch
    /// commits.
    #[allow(
        clippy::type_complexity,
        reason = "used once; a named type would only move it"
    )]
    pub(super) fn publish_changes(
        &mut self,
    ) -> Result<Vec<(String, Box<dyn Published>)>, LedgerError> {
        let mut out = Vec::new();
        for st in self.subs.iter_mut().flatten() {
            if st.changelog.changes.is_empty() {
                continue;
            }
            let changes = std::mem::take(&mut st.changelog.changes);
            hand_to_sink(st, &changes, &mut out)?;
        }
        Ok(out)
    }

    /// Hands the quarantine and dead-letter records this transaction stored or removed to
    /// their subscribers' changelogs (`records/`, [`RecordCopy`]); the caller waits for
    /// them before it commits, like for the batch's changes.
    #[allow(
        clippy::type_complexity,
        reason = "used once; a named type would only move it"
    )]
    pub(super) fn publish_records(
        &mut self,
    ) -> Result<Vec<(String, Box<dyn Published>)>, LedgerError> {
        let mut out = Vec::new();
        for st in self.subs.iter_mut().flatten() {
            let Some(copies) = st
                .changelog
                .record_copies
                .as_mut()
                .filter(|c| !c.is_empty())
            else {
                continue;
            };
            let changes: Vec<Change> = copies.drain(..).map(RecordCopy::into_change).collect();
            hand_to_sink(st, &changes, &mut out)?;
        }
        Ok(out)
    }

    /// [`Shard::publish_records`] for a transaction outside a batch: returns once they
    /// are acknowledged.
    pub(super) fn publish_records_now(&mut self) -> Result<(), LedgerError> {
        for (subscriber, p) in self.publish_records()? {
            p.wait().map_err(|e| LedgerError::Changelog {
                subscriber,
                detail: e.to_string(),
            })?;
        }
        Ok(())
    }

    /// Takes the subscriber's changelog sink from its registration, for the records a
    /// transaction outside a batch stores or removes (a batch takes it in `sync_handlers`).
    pub(super) fn refresh_changelog(&mut self, idx: usize) {
        let Some(st) = self.subs.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        if let Some(spec) = self.ctx.registry.get(st.id) {
            st.changelog.set(spec.changelog());
        }
    }
}

/// Hands a subscriber's changes to its changelog sink (none: they go nowhere) and keeps
/// the acknowledgements to wait for in `out`; a refusal stops the shard.
#[allow(
    clippy::type_complexity,
    reason = "used once; a named type would only move it"
)]
fn hand_to_sink(
    st: &SubState,
    changes: &[Change],
    out: &mut Vec<(String, Box<dyn Published>)>,
) -> Result<(), LedgerError> {
    let Some(sink) = &st.changelog.sink else {
        return Ok(());
    };
    let subscriber = st.name.to_string();
    match sink.publish(changes) {
        Ok(p) => {
            out.push((subscriber, p));
            Ok(())
        }
        Err(e) => Err(LedgerError::Changelog {
            subscriber,
            detail: e.to_string(),
        }),
    }
}
