//! Changes a subscriber's batches publish before they commit, and their replay.
//!
//! A subscriber with a [`ChangelogSink`] (the Kafka source installs one per subscription
//! with `changelog = true`, see `source/kafka/changelog.rs`) hands every processed
//! message's claim and handler-state effects to the sink **before** the batch commits
//! locally; the sink returns only when they are durable elsewhere (acknowledged by a
//! topic). The local ledger therefore never holds a processed message its changelog lacks:
//! it is a prefix-consistent copy of the changelog, and replaying the changelog on top of
//! it (or into an empty ledger) gives exactly the claims and state the changelog describes.
//! A sink that fails stops the shard like a failed commit (G7): nothing of the batch was
//! acknowledged, and the changes it did publish are replayed by whoever restores next.
//!
//! Replay goes through [`Job::restore`]: a job that stores a claim with its original times
//! and absorbs the effects into the subscriber's state, with no handler call, on the shard
//! the message itself would be placed on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{AckSender, ClaimRecord, Job, Origin, SubscriberId};
use crate::effects::Effects;

/// One processed message as a changelog carries it: its claim and the state it wrote, as
/// the handler wrote it (unscoped; `entity` names the scope).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// 128-bit hash of the idempotency key.
    pub key: u128,
    /// The idempotency key's text (for operators reading the topic).
    pub id: String,
    pub fingerprint: u64,
    pub processed_at_ms: u64,
    pub expires_at_ms: u64,
    pub handler_version: u64,
    /// The entity the message was placed by (its state scope), if any.
    pub entity: Option<String>,
    /// Handler state written (`None`: deleted), `insert-unique` marks, versions.
    pub state: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    pub uniques: BTreeSet<Vec<u8>>,
    pub versions: BTreeMap<String, u64>,
    /// Where the message came from; the sink routes the change by it. Not published.
    #[serde(skip)]
    pub origin: Option<Origin>,
}

impl Change {
    pub(crate) fn new(job: &Job, claim: ClaimRecord, effects: Option<Effects>) -> Change {
        let effects = effects.unwrap_or_default();
        Change {
            key: job.key,
            id: job.id.to_string(),
            fingerprint: claim.fingerprint,
            processed_at_ms: claim.processed_at_ms,
            expires_at_ms: claim.expires_at_ms,
            handler_version: claim.handler_version,
            entity: job.entity.as_deref().map(str::to_string),
            state: effects.state,
            uniques: effects.uniques,
            versions: effects.versions,
            origin: job.origin.clone(),
        }
    }

    pub fn claim(&self) -> ClaimRecord {
        ClaimRecord {
            fingerprint: self.fingerprint,
            processed_at_ms: self.processed_at_ms,
            expires_at_ms: self.expires_at_ms,
            handler_version: self.handler_version,
        }
    }

    /// The state effects, to absorb into a view scoped to `entity`.
    pub(crate) fn effects(&self) -> Effects {
        Effects {
            state: self.state.clone(),
            uniques: self.uniques.clone(),
            versions: self.versions.clone(),
            outbox: Vec::new(),
        }
    }

    pub fn has_effects(&self) -> bool {
        !(self.state.is_empty() && self.uniques.is_empty() && self.versions.is_empty())
    }
}

/// Where a subscriber's shards publish their changes before committing.
pub trait ChangelogSink: Send + Sync + std::fmt::Debug {
    /// Starts publishing the changes, in order per source partition. The shard writes the
    /// batch into its transaction meanwhile and commits only after [`Published::wait`]
    /// said every change is durable in the changelog; an error from either stops the
    /// shard without committing the batch.
    fn publish(&self, changes: &[Change]) -> Result<Box<dyn Published>, String>;
}

/// Changes on their way into a changelog.
pub trait Published: Send {
    /// Returns once every change is durable in the changelog, or why it is not.
    fn wait(self: Box<Self>) -> Result<(), String>;
}

/// Changes that were durable when `publish` returned.
pub struct AlreadyPublished;

impl Published for AlreadyPublished {
    fn wait(self: Box<Self>) -> Result<(), String> {
        Ok(())
    }
}

/// A slot for a subscriber's sink, read by its shards between batches.
pub(crate) type SinkSlot = std::sync::RwLock<Option<Arc<dyn ChangelogSink>>>;

impl Job {
    /// A job that replays a change from a changelog: it stores the claim (if it has not
    /// expired) and the state it wrote, with no handler call. Route it with
    /// [`super::Ledger::place`] and the change's entity, as the message itself was.
    pub fn restore(seq: u64, subscriber: SubscriberId, change: Change, ack: AckSender) -> Job {
        let mut job = Job::new(
            seq,
            subscriber,
            change.key,
            change.fingerprint,
            &change.id,
            &[],
            ack,
        );
        job.restore = Some(Box::new(change));
        job
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn a_change_keeps_the_claim_and_effects_it_was_made_from() {
        let job = Job::new(
            7,
            SubscriberId(3),
            42,
            9,
            "m-1",
            b"{}",
            crossbeam_channel::unbounded().0,
        );
        let claim = ClaimRecord {
            fingerprint: 9,
            processed_at_ms: 100,
            expires_at_ms: 200,
            handler_version: 5,
        };
        let mut effects = Effects::default();
        effects
            .state
            .insert(b"count/a".to_vec(), Some(b"1".to_vec()));
        effects.state.insert(b"gone".to_vec(), None);
        effects.uniques.insert(b"label\0a".to_vec());
        effects.versions.insert("v".into(), 4);
        let change = Change::new(&job, claim, Some(effects.clone()));
        assert_eq!(change.claim(), claim);
        assert_eq!((change.key, change.id.as_str()), (42, "m-1"));
        assert!(change.has_effects());
        assert_eq!(change.effects(), effects);
        let restore = Job::restore(
            1,
            SubscriberId(3),
            change.clone(),
            crossbeam_channel::unbounded().0,
        );
        assert_eq!((restore.key, restore.fingerprint), (42, 9));
        assert_eq!(restore.restore.as_deref(), Some(&change));
    }
}
