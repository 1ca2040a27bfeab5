//! TEMPORARY: stands in for the ledger operations promised on main until they are merged.
#![allow(dead_code)]
use std::sync::Arc;

use crate::config::SubscriberSettings;
use crate::ledger::{Ledger, LedgerError, Subscriber};

pub struct OutboxRow {
    pub id: String,
    pub subscriber: String,
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    pub written_at_ms: u64,
}

pub trait LedgerCompat {
    fn add_dead_letter(&self, s: &str, r: serde_json::Value) -> Result<String, LedgerError>;
    fn outbox_pending(&self, limit: usize) -> Result<Vec<OutboxRow>, LedgerError>;
    fn outbox_ack(&self, ids: &[String]) -> Result<(), LedgerError>;
}
impl LedgerCompat for Ledger {
    fn add_dead_letter(&self, _s: &str, _r: serde_json::Value) -> Result<String, LedgerError> {
        Ok(String::new())
    }
    fn outbox_pending(&self, _limit: usize) -> Result<Vec<OutboxRow>, LedgerError> {
        Ok(Vec::new())
    }
    fn outbox_ack(&self, _ids: &[String]) -> Result<(), LedgerError> {
        Ok(())
    }
}
pub trait SubscriberCompat {
    fn settings(&self) -> Arc<SubscriberSettings>;
}
impl SubscriberCompat for Subscriber {
    fn settings(&self) -> Arc<SubscriberSettings> {
        Arc::new(self.settings.clone())
    }
}
