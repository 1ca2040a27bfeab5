//! The dead-letter side of a consumer: records with no usable key and messages whose
//! handler gave up are kept in the ledger and, when `kafka.dead_letter_topic` is set,
//! produced there with the original key, payload and headers plus `dedupd-*` headers; an
//! offset is released only once the topic acknowledged its dead letter (G1).

use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use super::{Retained, Worker, WorkerContext, LOCAL_BITS, LOCAL_MASK};
use crate::ledger::StoredPayload;

/// Delivery reports of the dead-letter producer: (job seq, result).
pub(super) type DeliveryReport = (usize, Result<(), rdkafka::error::KafkaError>);

pub(super) struct DeliveryContext {
    pub(super) tx: Sender<DeliveryReport>,
}

impl ClientContext for DeliveryContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::source::kafka::logging::log(level, fac, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        crate::source::kafka::logging::error(&error, reason);
    }
}

impl ProducerContext for DeliveryContext {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: usize) {
        let r = match result {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e.clone()),
        };
        let _ = self.tx.send((seq, r));
    }
}

/// The producer for the dead-letter topic.
pub(super) struct DeadLetterTopic {
    pub(super) topic: String,
    pub(super) producer: ThreadedProducer<DeliveryContext>,
    pub(super) reports: Receiver<DeliveryReport>,
}

impl Worker {
    /// Input with no usable key: kept in the ledger as a dead letter, then (if configured)
    /// produced to the dead-letter topic; never dropped, never a crash.
    pub(super) fn reject(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        slot: u64,
        local: u64,
        origin: &str,
        reason: String,
    ) {
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::telemetry::metric::KAFKA_MESSAGES_TOTAL,
            "subscriber" => self.sub.name.to_string(), "outcome" => "rejected")
        .increment(1);
        let Some(p) = self.parts.get_mut(&slot) else {
            return;
        };
        let Some(mut r) = p.tracker.take_retained(local) else {
            return;
        };
        // The payload as records keep it: text when it is UTF-8, else base64, so a
        // binary record replays byte for byte.
        let mut record = serde_json::json!({
            "reason": reason,
            "attempts": 0,
            "origin": origin,
            "key": r.key.as_deref().map(String::from_utf8_lossy),
            "headers": r.headers.iter().map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned())).collect::<Vec<_>>(),
        });
        let payload = serde_json::to_value(StoredPayload::of(&r.payload));
        if let (Some(o), Ok(serde_json::Value::Object(p))) = (record.as_object_mut(), payload) {
            o.extend(p);
        }
        if let Err(e) = self.ledger.add_dead_letter(&self.sub.name, record) {
            self.fatal = Some(e.to_string());
            return;
        }
        r.reason = reason;
        r.attempts = 0;
        self.dead_letter(consumer, slot, local, r);
        // Without a dead-letter topic the message is resolved now: store its offset now,
        // not when a later message of the partition happens to arrive.
        self.advance(consumer, slot);
    }

    /// Sends a dead letter to the topic; without one, the ledger's record is all there is
    /// and the message is resolved at once.
    pub(super) fn dead_letter(
        &mut self,
        _consumer: &BaseConsumer<WorkerContext>,
        slot: u64,
        local: u64,
        r: Retained,
    ) {
        let Some(p) = self.parts.get_mut(&slot) else {
            return;
        };
        let Some(dlq) = &self.dlq else {
            p.tracker.resolve(local);
            return;
        };
        let seq = ((slot << LOCAL_BITS) | local) as usize;
        let offset = p.tracker.offset_of(local).unwrap_or(-1);
        let mut headers = OwnedHeaders::new_with_capacity(6 + r.headers.len());
        let attempts = r.attempts.to_string();
        let partition = p.partition.to_string();
        let offset_text = offset.to_string();
        for (k, v) in [
            ("dedupd-subscriber", &*self.sub.name),
            ("dedupd-reason", r.reason.as_str()),
            ("dedupd-attempts", attempts.as_str()),
            ("dedupd-original-topic", &*p.topic),
            ("dedupd-original-partition", partition.as_str()),
            ("dedupd-original-offset", offset_text.as_str()),
        ] {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_slice()),
            });
        }
        let mut record: BaseRecord<'_, [u8], [u8], usize> =
            BaseRecord::with_opaque_to(&dlq.topic, seq)
                .payload(r.payload.as_slice())
                .headers(headers);
        if let Some(k) = r.key.as_deref() {
            record = record.key(k);
        }
        let sent = dlq.producer.send(record).map_err(|(e, _)| e.to_string());
        if let Err(e) = sent {
            // Queue full or similar: the poll loop tries again shortly.
            tracing::warn!(subscriber = %self.sub.name, "dead-letter produce failed, retrying: {e}");
            self.unsent.push((slot, local));
        }
        p.tracker.put_retained(local, r);
    }

    /// Produces again the dead letters whose `send` failed.
    pub(super) fn retry_unsent(&mut self, consumer: &BaseConsumer<WorkerContext>) {
        for (slot, local) in std::mem::take(&mut self.unsent) {
            let r = self
                .parts
                .get_mut(&slot)
                .and_then(|p| p.tracker.take_retained(local));
            if let Some(r) = r {
                self.dead_letter(consumer, slot, local, r);
            }
        }
    }

    pub(super) fn on_delivery(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        (seq, result): DeliveryReport,
    ) {
        let seq = seq as u64;
        let (slot, local) = (seq >> LOCAL_BITS, seq & LOCAL_MASK);
        let Some(p) = self.parts.get_mut(&slot) else {
            return;
        };
        match result {
            Ok(()) => {
                let _ = p.tracker.take_retained(local);
                p.tracker.resolve(local);
                self.advance(consumer, slot);
            }
            Err(e) => {
                tracing::warn!(subscriber = %self.sub.name, "dead-letter delivery failed, producing again: {e}");
                if let Some(r) = p.tracker.take_retained(local) {
                    self.dead_letter(consumer, slot, local, r);
                }
            }
        }
    }

    /// A dead-lettered or rejected message: to the dead-letter topic when it was retained
    /// for that, else its offset is released at once.
    pub(super) fn set_aside(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        slot: u64,
        local: u64,
        reason: String,
        attempts: u32,
        touched: &mut Vec<u64>,
    ) {
        let r = self
            .parts
            .get_mut(&slot)
            .and_then(|p| p.tracker.take_retained(local));
        match r {
            Some(mut r) => {
                r.attempts = attempts;
                r.reason = reason;
                self.dead_letter(consumer, slot, local, r);
            }
            None => {
                if let Some(p) = self.parts.get_mut(&slot) {
                    p.tracker.resolve(local);
                }
            }
        }
        if touched.last() != Some(&slot) {
            touched.push(slot);
        }
    }
}
