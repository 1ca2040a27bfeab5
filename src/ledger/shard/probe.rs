//! The shard's side of the cross-shard probe protocol (`placement.rs`): a key with no
//! live claim here, of a subscriber whose claims may be on other shards, is held in
//! flight while every other shard answers with its newest record of the key (I2).
//! Probes are answered between batches, so only committed claims are reported.

use super::*;

impl Shard {
    /// Answers another shard's probe from this shard's committed claims, or takes an
    /// answer to one of ours; when every shard answered, its jobs join the next batch.
    pub(super) fn peer(&mut self, msg: PeerMsg) {
        match msg {
            PeerMsg::Probe { from, group, keys } => {
                let found = self.probe_answer(&keys);
                if let Some(peer) = self.ctx.peers.get().and_then(|p| p.get(from)) {
                    let _ = peer.send(PeerMsg::Reply { group, found });
                }
            }
            PeerMsg::Reply { group, found } => {
                let Some(g) = self.probing.get_mut(&group) else {
                    return;
                };
                match found {
                    Ok(found) => {
                        for (mine, theirs) in g.found.iter_mut().zip(found) {
                            *mine = ClaimRecord::newer(*mine, theirs);
                        }
                    }
                    Err(e) => {
                        g.failed.get_or_insert(e);
                    }
                }
                g.outstanding -= 1;
                if g.outstanding == 0 {
                    if let Some(g) = self.probing.remove(&group) {
                        self.probe_done(g);
                    }
                }
            }
        }
    }

    fn probe_done(&mut self, g: ProbeGroup) {
        if let Some(e) = g.failed {
            let reason = e.to_string();
            let pairs: Vec<_> = g.jobs.iter().map(|j| (j.subscriber, j.key)).collect();
            self.ctx.inflight.release(pairs, self.ctx.index);
            send_outcomes(
                g.jobs
                    .into_iter()
                    .map(|j| {
                        (
                            j,
                            Outcome::Failed {
                                reason: reason.clone(),
                            },
                        )
                    })
                    .collect(),
            );
            return;
        }
        for (mut job, found) in g.jobs.into_iter().zip(g.found) {
            job.probed = Some(found);
            self.batch.push(job);
        }
    }

    /// The newest record of each key in this shard, tombstones included (I2).
    fn probe_answer(
        &mut self,
        keys: &[(SubscriberId, u128)],
    ) -> Result<Vec<Option<ClaimRecord>>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut txn = None;
        let mut out = Vec::with_capacity(keys.len());
        for &(sub, key) in keys {
            out.push(self.newest_record(sub, key, &mut txn)?);
        }
        // Asked for a subscriber's claims: publish them, so the next keys need no probe.
        let mut last = None;
        for &(sub, _) in keys {
            if last.replace(sub) == Some(sub) {
                continue;
            }
            let idx = sub.0 as usize;
            let placements = self
                .ctx
                .registry
                .get(sub)
                .map(|s| s.placements.load(Ordering::Acquire));
            if let (Some(Some(st)), Some(placements)) = (self.subs.get_mut(idx), placements) {
                if st.placement.presence.is_none()
                    && placement::needs_probe(placements | st.placement.disk_mask, self.ctx.count)
                {
                    st.placement.presence = Some(super::decide::start_presence(st, &self.ctx));
                }
            }
        }
        Ok(out)
    }

    /// Sends this batch's probes: one message per other shard for all of its keys.
    pub(super) fn send_probes(&mut self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let keys: Vec<(SubscriberId, u128)> = jobs.iter().map(|j| (j.subscriber, j.key)).collect();
        // Counted before any of these jobs' outcomes can go out.
        self.ctx
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .probed_keys += keys.len() as u64;
        self.next_group += 1;
        let group = self.next_group;
        let mut g = ProbeGroup {
            found: vec![None; jobs.len()],
            jobs,
            outstanding: 0,
            failed: None,
        };
        let peers = self
            .ctx
            .peers
            .get()
            .map(|p| p.as_slice())
            .unwrap_or_default();
        for (i, peer) in peers.iter().enumerate() {
            if i == self.ctx.index {
                continue;
            }
            let probe = PeerMsg::Probe {
                from: self.ctx.index,
                group,
                keys: keys.clone(),
            };
            if peer.send(probe).is_ok() {
                g.outstanding += 1;
            } else {
                g.failed = Some(LedgerError::Poisoned(format!("shard {i} stopped")));
            }
        }
        if g.outstanding == 0 {
            self.probe_done(g);
        } else {
            self.probing.insert(group, g);
        }
    }
}
