//! The outbox for relays: pending rows, acknowledgement once a broker took them, the
//! relay's attachment and wake-ups, and the restore of emitted messages a changelog
//! carried.

use super::*;

/// A message a handler emitted, waiting to be relayed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OutboxRow {
    /// `{shard}-{seq}`: pass to [`Ledger::outbox_ack`] once the broker acknowledged it.
    pub id: String,
    pub(crate) subscriber: String,
    /// Deterministic id derived from the incoming message id (the same on every redelivery).
    pub message_id: String,
    pub topic: String,
    pub(crate) key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    pub written_at_ms: u64,
    /// The changelog partition holding the message's emitted record: the Kafka relay
    /// tombstones it there once the broker acknowledged the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) changelog_partition: Option<i32>,
}

impl Ledger {
    /// Outbox rows waiting for the relay, oldest first per shard, at most `limit` in all.
    pub fn outbox_pending(&self, limit: usize) -> Result<Vec<OutboxRow>, LedgerError> {
        let mut out = Vec::new();
        let per_shard = limit.div_ceil(self.shards.len().max(1)).max(1);
        let pending = self.ask_all(|reply| Control::OutboxPending {
            limit: per_shard,
            reply,
        })?;
        for (shard, rows) in pending.into_iter().enumerate() {
            for (seq, bytes) in rows {
                let unreadable = |e: crate::ledger::records::StoredRecordError| {
                    LedgerError::Invalid(format!("outbox row {shard}-{seq} is unreadable: {e}"))
                };
                let r = OutboxRecord::decode(&bytes).map_err(unreadable)?;
                out.push(OutboxRow {
                    id: format!("{shard}-{seq}"),
                    payload: r.payload.bytes().map_err(unreadable)?,
                    subscriber: r.subscriber,
                    message_id: r.id,
                    topic: r.topic,
                    key: r.key,
                    headers: r.headers,
                    written_at_ms: r.written_at_ms,
                    changelog_partition: r.changelog_partition,
                });
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Puts messages a changelog restore found emitted and not relayed back into the
    /// outbox of `subscriber`, except those whose id is pending already (this data
    /// directory wrote them before), and wakes the relay. The shards write equal parts at
    /// the same time, one durable transaction each. Returns how many rows it wrote.
    pub(crate) fn outbox_restore(
        &self,
        subscriber: &str,
        messages: Vec<crate::effects::OutboxMessage>,
    ) -> Result<u64, LedgerError> {
        if messages.is_empty() {
            return Ok(0);
        }
        let pending: std::collections::HashSet<String> = self
            .outbox_pending(usize::MAX)?
            .into_iter()
            .filter(|r| r.subscriber == subscriber)
            .map(|r| r.message_id)
            .collect();
        let messages: Vec<_> = messages
            .into_iter()
            .filter(|m| !pending.contains(&m.id))
            .collect();
        let n = messages.len() as u64;
        if n == 0 {
            return Ok(0);
        }
        let part = messages.len().div_ceil(self.shards.len().max(1));
        let mut replies = Vec::new();
        let mut messages = messages.into_iter().peekable();
        for shard in &self.shards {
            if messages.peek().is_none() {
                break;
            }
            let (tx, rx) = bounded(1);
            shard
                .tx
                .send(ShardMsg::Control(Control::OutboxWrite {
                    subscriber: subscriber.to_string(),
                    messages: messages.by_ref().take(part).collect(),
                    reply: tx,
                }))
                .map_err(|_| stopped())?;
            replies.push(rx);
        }
        for rx in replies {
            rx.recv().map_err(|_| stopped())??;
        }
        self.wake_outbox_relay();
        Ok(n)
    }

    /// Outbox rows pending in all shards.
    pub(crate) fn outbox_len(&self) -> Result<u64, LedgerError> {
        Ok(self
            .ask_all(|reply| Control::OutboxLen { reply })?
            .into_iter()
            .sum())
    }

    /// Marks the outbox as relayed to Kafka until the guard drops, so the HTTP pull route
    /// refuses to hand the same rows to a second consumer.
    pub fn attach_outbox_relay(&self) -> OutboxRelayGuard<'_> {
        self.outbox_relay
            .store(true, std::sync::atomic::Ordering::SeqCst);
        OutboxRelayGuard(&self.outbox_relay)
    }

    /// Whether a Kafka relay consumes the outbox.
    pub(crate) fn outbox_relayed(&self) -> bool {
        self.outbox_relay.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes the relay read the outbox now rather than after its poll interval.
    pub(crate) fn wake_outbox_relay(&self) {
        self.outbox_wakes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many times [`Ledger::wake_outbox_relay`] was called (the relay sleeps while it
    /// does not change).
    pub(crate) fn outbox_wakes(&self) -> u64 {
        self.outbox_wakes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until every outbox row pending now has been relayed (and deleted), waking
    /// the relay first, or until `deadline`. Returns the rows waited for and whether they
    /// were all relayed. Rows written meanwhile are not waited for.
    pub(crate) fn wait_outbox_relayed(
        &self,
        deadline: std::time::Instant,
    ) -> Result<(u64, bool), LedgerError> {
        let marks: Vec<Option<(u64, u64)>> = self.ask_all(|reply| Control::OutboxSpan { reply })?;
        if marks.iter().all(Option::is_none) {
            return Ok((0, true));
        }
        // Rows pending now; those written after the spans were read are not waited for.
        let rows = self.outbox_len()?;
        self.wake_outbox_relay();
        loop {
            let now: Vec<Option<(u64, u64)>> =
                self.ask_all(|reply| Control::OutboxSpan { reply })?;
            let relayed = now.iter().zip(&marks).all(|(now, then)| match (now, then) {
                (Some((oldest, _)), Some((_, newest))) => oldest > newest,
                _ => true,
            });
            if relayed {
                return Ok((rows, true));
            }
            if std::time::Instant::now() >= deadline {
                return Ok((rows, false));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Deletes relayed outbox rows (call only after the broker acknowledged them).
    pub fn outbox_ack(&self, ids: &[String]) -> Result<(), LedgerError> {
        let mut by_shard: Vec<Vec<u64>> = vec![Vec::new(); self.shards.len()];
        for id in ids {
            let (shard, seq) = self.record_ref(id)?;
            by_shard[shard].push(seq);
        }
        for (shard, seqs) in by_shard.into_iter().enumerate() {
            if !seqs.is_empty() {
                self.ask(shard, |reply| Control::OutboxAck { seqs, reply })?;
            }
        }
        Ok(())
    }
}

/// Held while a Kafka relay consumes the outbox ([`Ledger::attach_outbox_relay`]).
pub struct OutboxRelayGuard<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for OutboxRelayGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}
