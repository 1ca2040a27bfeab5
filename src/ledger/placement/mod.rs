//! Where a subscriber's messages are decided, and how a claim is found when a delivery
//! lands on another shard than an earlier one (invariant I6 in `docs/design.md`).
//!
//! Routing is a performance choice, never a correctness one. Three placements exist:
//!
//! - [`Placement::ByKey`]: subscribers without a handler. The shard is chosen by the
//!   idempotency key's hash, so every delivery of an id meets its claim on the same shard;
//!   a configured `partition_key` is ignored (without handler state it has nothing to keep
//!   together).
//! - [`Placement::Subscriber`]: a handler subscriber without a partition key. All of its
//!   messages run on one shard (chosen by the subscriber's name), so its handler state is
//!   one store: `insert-unique`, `advance-version` and `get` see every earlier message.
//! - [`Placement::Entity`]: a handler subscriber with a partition key (e.g. the order id).
//!   Messages of one entity run on one shard, and handler state is scoped to the entity:
//!   the host prefixes every state key, mark and version with it, so a handler sees one
//!   store per entity whatever shard the entity lands on.
//!
//! A claim is written where its message was decided. When a subscriber's claims may be on
//! more than one shard for the same id — entity placement (a redelivery can carry another
//! entity key), a placement that changed (a handler added or removed, a partition key
//! configured), a replay, or data written by format 1 — each shard records that in the
//! subscriber's *placement mask* (table `placements_v1`, one byte per subscriber), and a
//! shard that finds no live claim of its own asks the other shards before it decides
//! "new" (a *probe*, answered between their batches, so only committed claims are seen).
//! Two shards deciding the same id at once are kept apart by the [`InFlight`] set: a shard
//! takes `(subscriber, key)` before it probes and gives it back only after the batch that
//! decided it committed; the other shard waits and then finds the committed claim.
//! Subscribers whose claims all live under one placement of ByKey or Subscriber (the
//! default configuration) never probe and never touch the set.
//!
//! `presence.rs`: what each shard publishes of the claims it holds, so that most keys
//! need no probe.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

pub(crate) mod presence;

use super::shard::Control;
use super::{Job, Ledger, LedgerError, Subscriber, SubscriberId};

/// How a message chose its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Placement {
    /// By the idempotency key's hash (no handler).
    #[default]
    ByKey,
    /// On the subscriber's own shard (a handler, no partition key).
    Subscriber,
    /// On the entity's shard (a handler and a partition key); state is scoped to it.
    Entity,
}

/// A subscriber's placement on one shard: whether this batch probes, the bits recorded,
/// the key source in force and recorded, and what it publishes for the other shards.
pub(crate) struct SubPlacement {
    /// Whether this batch asks the other shards before deciding "new".
    pub(crate) probe: bool,
    /// Placement bits recorded for this subscriber in this shard's `placements_v1`.
    pub(crate) disk_mask: u8,
    /// Bits of claims written in the current batch, recorded with its commit.
    pub(crate) mask_pending: u8,
    /// The key source in force ([`crate::ledger::key_source_text`]), and the one this
    /// shard's `key_sources_v1` records for the subscriber's claims.
    pub(crate) key_source: Arc<str>,
    pub(crate) key_source_on_disk: Option<Arc<str>>,
    /// What this shard publishes of the subscriber's records for the other shards, while
    /// they probe for its claims (`presence.rs`).
    pub(crate) presence: Option<presence::PresenceWriter>,
}

/// Bits of a placement mask: which placements a subscriber's claims were written under.
pub(crate) const BY_KEY: u8 = 1;
pub(crate) const SUBSCRIBER: u8 = 2;
pub(crate) const ENTITY: u8 = 4;
/// Claims that may sit on any shard: written by format 1 (routing then followed the
/// configured partition key), or on another shard than their placement chose (replay).
pub(crate) const ANYWHERE: u8 = 8;

impl Placement {
    pub(crate) fn bit(self) -> u8 {
        match self {
            Placement::ByKey => BY_KEY,
            Placement::Subscriber => SUBSCRIBER,
            Placement::Entity => ENTITY,
        }
    }

    /// The placement a subscriber's new messages get.
    pub(crate) fn of(has_handler: bool, has_partition_key: bool) -> Placement {
        match (has_handler, has_partition_key) {
            (false, _) => Placement::ByKey,
            (true, false) => Placement::Subscriber,
            (true, true) => Placement::Entity,
        }
    }
}

/// Whether a subscriber whose claims were written under `mask` must ask the other shards
/// before deciding that a message is new.
#[inline]
pub(crate) fn needs_probe(mask: u8, shards: usize) -> bool {
    shards > 1 && (mask & (ENTITY | ANYWHERE) != 0 || mask.count_ones() > 1)
}

impl Ledger {
    /// Chooses the shard that decides a keyed job under its subscriber's placement
    /// (`placement.rs`) and records the placement in the job. `entity` is the partition
    /// key's text when the subscriber configures one (`crate::envelope::derive_entity`);
    /// it matters only to subscribers with a handler.
    pub fn place(&self, sub: &Subscriber, job: &mut Job, entity: Option<String>) -> usize {
        self.place_as(sub, sub.has_handler.load(Ordering::Acquire), job, entity)
    }

    /// [`Ledger::place`] with the subscriber's handler flag as the caller read it (when
    /// it derived the entity by that same reading).
    pub(crate) fn place_as(
        &self,
        sub: &Subscriber,
        has_handler: bool,
        job: &mut Job,
        entity: Option<String>,
    ) -> usize {
        let placement = Placement::of(has_handler, entity.is_some());
        let bit = placement.bit();
        if sub.placements.load(Ordering::Acquire) & bit == 0 {
            sub.placements.fetch_or(bit, Ordering::AcqRel);
        }
        job.placement = placement;
        match placement {
            Placement::ByKey => self.route(job.key),
            Placement::Subscriber => self.route(crate::envelope::key_hash(sub.name.as_bytes())),
            Placement::Entity => {
                let shard = self.route(crate::envelope::key_hash(
                    entity.as_deref().unwrap_or_default().as_bytes(),
                ));
                job.entity = entity.map(String::into_boxed_str);
                shard
            }
        }
    }

    /// Refuses a handler placement under which the subscriber's existing handler state
    /// would be split or invisible: state written under the subscriber placement is one
    /// unscoped store, state written under an entity placement is scoped per entity, and
    /// state written by format 1 may be split across shards.
    pub(super) fn check_state_scope(
        &self,
        sub: &Subscriber,
        next: Placement,
    ) -> Result<(), LedgerError> {
        let other = match next {
            Placement::ByKey => return Ok(()),
            Placement::Subscriber => ENTITY | ANYWHERE,
            Placement::Entity => SUBSCRIBER | ANYWHERE,
        };
        let mask = sub.placements.load(Ordering::Acquire);
        if mask & other == 0 || self.state_len(&sub.name)? == 0 {
            return Ok(());
        }
        let written = if mask & ANYWHERE != 0 {
            "by an older dedupd (format 1), which split it by shard"
        } else if mask & ENTITY != 0 {
            "scoped per entity (a partition key was configured)"
        } else {
            "as one store (no partition key was configured)"
        };
        let wanted = match next {
            Placement::Entity => "scoped per entity, because a partition key is configured now",
            _ => "as one store, because no partition key is configured now",
        };
        Err(LedgerError::Invalid(format!(
            "subscriber {:?} has handler state written {written}; its handler would read it {wanted}, \
             and would miss entries (one order, two labels). Restore the subscriber's earlier \
             `partition_key`, or give the handler a new subscriber name or data directory \
             (`dedupd state dump` prints the old state)",
            sub.name
        )))
    }

    /// Makes every shard probe for `sub`'s claims before its messages may be decided under
    /// `next`, when its claims were written under another placement. Returns after every
    /// shard finished the batch it was in, so no shard still decides without probing.
    pub(super) fn prepare_placement(
        &self,
        sub: &Subscriber,
        next: Placement,
    ) -> Result<(), LedgerError> {
        let before = sub.placements.fetch_or(next.bit(), Ordering::AcqRel);
        if before == 0 || before & next.bit() != 0 {
            return Ok(());
        }
        tracing::info!(subscriber = %sub.name, placement = ?next,
            "placement changed: shards now ask each other for this subscriber's claims");
        self.ask_all(|reply| Control::Sync { reply })?;
        Ok(())
    }
}

/// The `(subscriber, key)` pairs that a shard is deciding with a probe, and which shard
/// holds each. Bounded by the messages in flight.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    held: Mutex<HashMap<(u32, u128), usize>>,
}

/// What [`InFlight::acquire`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Acquire {
    /// Taken by the asking shard: it may probe and decide.
    Taken,
    /// Held by a shard (the asker itself for another job of the same key): wait.
    Busy,
}

impl InFlight {
    pub(crate) fn acquire(&self, sub: SubscriberId, key: u128, shard: usize) -> Acquire {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        match held.entry((sub.0, key)) {
            std::collections::hash_map::Entry::Occupied(_) => Acquire::Busy,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(shard);
                Acquire::Taken
            }
        }
    }

    /// Gives back pairs this shard holds (after the batch that decided them committed, or
    /// when the shard stops).
    pub(crate) fn release(
        &self,
        pairs: impl IntoIterator<Item = (SubscriberId, u128)>,
        shard: usize,
    ) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for (sub, key) in pairs {
            if held.get(&(sub.0, key)) == Some(&shard) {
                held.remove(&(sub.0, key));
            }
        }
    }

    /// Gives back everything a shard holds.
    pub(crate) fn release_all(&self, shard: usize) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|_, s| *s != shard);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// The prefix that scopes an entity's handler state: the entity's text and a NUL byte
/// (entity keys hold no NUL; [`crate::envelope::derive_entity`] refuses them).
pub(crate) fn entity_scope(entity: &str) -> Vec<u8> {
    let mut s = Vec::with_capacity(entity.len() + 1);
    s.extend_from_slice(entity.as_bytes());
    s.push(0);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_configurations_never_probe() {
        assert!(!needs_probe(BY_KEY, 2));
        assert!(!needs_probe(SUBSCRIBER, 2));
        assert!(!needs_probe(0, 2));
    }

    #[test]
    fn entity_mixed_and_anywhere_placements_probe() {
        assert!(needs_probe(ENTITY, 2));
        assert!(needs_probe(BY_KEY | SUBSCRIBER, 2));
        assert!(needs_probe(BY_KEY | ANYWHERE, 2));
        assert!(
            !needs_probe(ENTITY | ANYWHERE, 1),
            "one shard has nobody to ask"
        );
    }

    #[test]
    fn in_flight_pair_is_held_until_released_by_its_holder() {
        let f = InFlight::default();
        let s = SubscriberId(0);
        assert_eq!(f.acquire(s, 7, 0), Acquire::Taken);
        assert_eq!(f.acquire(s, 7, 1), Acquire::Busy);
        assert_eq!(f.acquire(s, 7, 0), Acquire::Busy);
        f.release([(s, 7)], 1);
        assert_eq!(f.len(), 1, "only the holder releases");
        f.release([(s, 7)], 0);
        assert_eq!(f.acquire(s, 7, 1), Acquire::Taken);
        f.release_all(1);
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn placement_follows_handler_and_partition_key() {
        assert_eq!(Placement::of(false, true), Placement::ByKey);
        assert_eq!(Placement::of(true, false), Placement::Subscriber);
        assert_eq!(Placement::of(true, true), Placement::Entity);
    }
}
