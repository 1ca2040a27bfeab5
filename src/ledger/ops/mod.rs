//! Operations for operators and relays, by what they act on: claims and settings here
//! (forget, settings changes, changelog checkpoints), `records.rs` (quarantine and
//! dead-letter records: list, inspect, replay, discard), `outbox.rs` (the outbox and its
//! relay) and `backup.rs` (online backups). Each write runs on the owning shard's writer
//! thread between two batches, so it never interleaves with a batch, and is durable before
//! it returns; reads of records use read transactions of their own.

mod backup;
mod outbox;
mod records;

pub(crate) use backup::ShardCopy;
pub use outbox::{OutboxRelayGuard, OutboxRow};
pub use records::{RecordKind, StoredRecord};

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::bounded;
use serde::{Deserialize, Serialize};

use super::backends::tracked::Rendezvous;
use super::format::datadir::MANIFEST;
use super::offline::close_copied_shard;
use super::records::outbox::OutboxRecord;
use super::shard::{Control, ShardMsg};
use super::{AckSender, Ledger, LedgerError, Origin, Placement};
use crate::config::SubscriberSettings;
use crate::envelope::{key_hash, IdempotencyKey};
use crate::source::delivery::{route, Delivery, Keying, Payload, Routed, Target};

fn parse_id(id: &str) -> Option<(usize, u64)> {
    let (shard, seq) = id.split_once('-')?;
    Some((shard.parse().ok()?, seq.parse().ok()?))
}

fn stopped() -> LedgerError {
    LedgerError::Poisoned("shard writer stopped".into())
}

impl Ledger {
    fn ask<T>(
        &self,
        shard: usize,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T, LedgerError>>) -> Control,
    ) -> Result<T, LedgerError> {
        let (tx, rx) = bounded(1);
        self.shards[shard]
            .tx
            .send(ShardMsg::Control(make(tx)))
            .map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())?
    }

    /// Sends one control request to every shard, then collects the answers in shard
    /// order. The shards work on it at the same time, each between two of its batches.
    pub(super) fn ask_all<T>(
        &self,
        make: impl Fn(crossbeam_channel::Sender<Result<T, LedgerError>>) -> Control,
    ) -> Result<Vec<T>, LedgerError> {
        let mut replies = Vec::with_capacity(self.shards.len());
        for shard in &self.shards {
            let (tx, rx) = bounded(1);
            shard
                .tx
                .send(ShardMsg::Control(make(tx)))
                .map_err(|_| stopped())?;
            replies.push(rx);
        }
        replies
            .into_iter()
            .map(|rx| rx.recv().map_err(|_| stopped())?)
            .collect()
    }

    /// Forgets the live claim of `(subscriber, key)` so its next delivery is processed
    /// again. Writes a tombstone that shadows every older copy of the claim until that
    /// claim would have expired. `Ok(false)`: there was no live claim.
    pub fn forget(&self, subscriber: &str, key: u128) -> Result<bool, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        // Every shard that holds a live copy writes its tombstone (see `placement.rs`).
        let forgot = self.ask_all(|reply| Control::Forget {
            sub: sub.id,
            key,
            reply,
        })?;
        Ok(forgot.into_iter().any(|f| f))
    }

    /// The changelog checkpoint stored under `key` (`<changelog topic>/<partition>`): an
    /// offset before which every change of that partition is in this data directory.
    pub(crate) fn changelog_checkpoint(&self, key: &str) -> Result<Option<u64>, LedgerError> {
        self.ask(0, |reply| Control::Checkpoint {
            key: key.to_string(),
            reply,
        })
    }

    /// Stores a changelog checkpoint, durably. Call it only once every change before
    /// `offset` is durable here: a checkpoint may lag (a restore then replays more, which
    /// is harmless) but never lead.
    pub(crate) fn set_changelog_checkpoint(
        &self,
        key: &str,
        offset: u64,
    ) -> Result<(), LedgerError> {
        self.set_changelog_checkpoints(vec![(key.to_string(), offset)])
    }

    /// Stores several changelog checkpoints (or values kept beside them) in one
    /// transaction: all of them durable, or none.
    pub(crate) fn set_changelog_checkpoints(
        &self,
        entries: Vec<(String, u64)>,
    ) -> Result<(), LedgerError> {
        self.ask(0, |reply| Control::SetCheckpoints { entries, reply })
    }

    /// Replaces a subscriber's settings at runtime. Shards take the TTL and retry policy
    /// between batches (claims already written keep their expiry); sources read the key
    /// source for each new message. Validation is the caller's.
    pub fn update_settings(
        &self,
        subscriber: &str,
        settings: SubscriberSettings,
    ) -> Result<(), LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        super::check_key_source(&sub, &settings.key, self.clock.now_ms())?;
        let keyed = settings.partition_key != crate::config::PartitionSource::IdempotencyKey;
        self.prepare_placement(&sub, Placement::of(sub.handler().is_some(), keyed))?;
        *sub.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(settings);
        sub.settings_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}
