//! Deterministic synthetic traffic: new events, redeliveries of earlier events, and
//! events that reuse an earlier id with a different payload.
//!
//! Redeliveries pick uniformly among *all* earlier events, not just recent ones: the
//! harder case for a deduplicator, since most of them hit sealed generations on disk.

use std::fmt::Write as _;

use rand::{rngs::SmallRng, Rng, SeedableRng};

/// What traffic to generate.
#[derive(Debug, Clone, Copy)]
pub struct TrafficSpec {
    pub seed: u64,
    pub messages: u64,
    /// Fraction of messages that redeliver an earlier event unchanged.
    pub dup_rate: f64,
    /// Fraction of messages that reuse an earlier id with a different payload.
    pub mismatch_rate: f64,
    pub subscribers: u32,
    /// `order_id` as 16 hex digits of a hash of the order number, instead of the number:
    /// what UUID-like ids look like to sorted state tables (any position, not appends).
    pub random_order_ids: bool,
    /// Spread new events over this many orders (each event's order picked by a hash of
    /// its index), so a handler keeping state per order mostly reads and updates state
    /// that exists: the read-modify-write case. `None`: a new order per new event (and
    /// `ORDER_REUSE_RATE` of them an earlier one's).
    pub orders: Option<u64>,
}

/// Share of new events that carry an earlier event's order id under a fresh event id (a
/// producer-side retry): message-id dedup cannot catch these, business uniqueness can.
pub(crate) const ORDER_REUSE_RATE: f64 = 0.02;

/// What the engine must answer for an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    New,
    Duplicate,
    Mismatch,
}

/// One generated event. Buffers are reused between calls to `next_into`.
#[derive(Debug, Default)]
pub struct Event {
    pub(crate) subscriber: u32,
    pub id: String,
    /// The order the event is about (`order_id` in the payload is `o-<order>`).
    pub(crate) order: u64,
    pub(crate) payload: Vec<u8>,
    pub expect: Option<Expect>,
}

/// The generator. The same spec yields the same sequence.
pub struct Traffic {
    spec: TrafficSpec,
    rng: SmallRng,
    produced: u64,
    unique: u64,
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Traffic {
    pub fn new(spec: TrafficSpec) -> Self {
        Traffic {
            rng: SmallRng::seed_from_u64(spec.seed),
            spec,
            produced: 0,
            unique: 0,
        }
    }

    /// Distinct events generated so far.
    #[cfg(test)]
    pub(crate) fn unique(&self) -> u64 {
        self.unique
    }

    /// Fills `ev` with the next event; `false` when the spec's count is reached.
    pub fn next_into(&mut self, ev: &mut Event) -> bool {
        if self.produced >= self.spec.messages {
            return false;
        }
        self.produced += 1;
        let roll: f64 = self.rng.random();
        let (index, variant, expect) =
            if self.unique == 0 || roll >= self.spec.dup_rate + self.spec.mismatch_rate {
                self.unique += 1;
                (self.unique - 1, 0, Expect::New)
            } else {
                let j = self.rng.random_range(0..self.unique);
                if roll < self.spec.dup_rate {
                    (j, 0, Expect::Duplicate)
                } else {
                    (j, 1 + (self.produced % 7), Expect::Mismatch)
                }
            };
        self.fill(index, variant, ev);
        ev.expect = Some(expect);
        true
    }

    /// The order of event `index`: its own, or (for a few) an earlier event's.
    fn order_of(&self, index: u64) -> u64 {
        let r = mix(self.spec.seed.rotate_left(17) ^ index);
        if let Some(orders) = self.spec.orders {
            return mix(r) % orders.max(1);
        }
        let unit = (r >> 11) as f64 / (1u64 << 53) as f64;
        if index > 0 && unit < ORDER_REUSE_RATE {
            mix(r) % index
        } else {
            index
        }
    }

    fn fill(&self, index: u64, variant: u64, ev: &mut Event) {
        let h = mix(self.spec.seed ^ index);
        let h2 = mix(h);
        ev.order = self.order_of(index);
        ev.subscriber = (index % self.spec.subscribers.max(1) as u64) as u32;
        ev.id.clear();
        let _ = write!(
            ev.id,
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            h >> 32,
            (h >> 16) & 0xffff,
            h & 0xfff,
            h2 >> 48,
            h2 & 0xffff_ffff_ffff
        );
        ev.payload.clear();
        let amount = (h2 % 100_000) + variant * 17;
        let mut out = VecWriter(&mut ev.payload);
        let _ = write!(
            out,
            r#"{{"amount_cents":{amount},"currency":"EUR","order_id":"o-"#
        );
        if self.spec.random_order_ids {
            let _ = write!(out, "{:016x}", mix(ev.order ^ 0x5eed_0bde_5eed_0bde));
        } else {
            let _ = write!(out, "{}", ev.order);
        }
        let _ = write!(
            out,
            r#"","qty":{},"sku":"SKU-{:05}","type":"OrderPlaced"}}"#,
            1 + h % 5,
            h2 % 50_000
        );
    }
}

struct VecWriter<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for VecWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TrafficSpec {
        TrafficSpec {
            seed: 1,
            messages: 10_000,
            dup_rate: 0.1,
            mismatch_rate: 0.01,
            subscribers: 3,
            random_order_ids: false,
            orders: None,
        }
    }

    #[test]
    fn a_fixed_number_of_orders_is_revisited() {
        let mut t = Traffic::new(TrafficSpec {
            orders: Some(100),
            ..spec()
        });
        let mut ev = Event::default();
        let mut orders = std::collections::HashMap::<u64, u32>::new();
        let mut new_events = 0;
        while t.next_into(&mut ev) {
            if ev.expect == Some(Expect::New) {
                new_events += 1;
                *orders.entry(ev.order).or_default() += 1;
            }
        }
        // About 8,900 new events over 100 orders: every order is revisited many times.
        assert_eq!(orders.len(), 100);
        assert!(orders.keys().all(|&o| o < 100));
        assert!(orders.values().all(|&n| n > 30), "{orders:?}");
        assert!(new_events > 8_000, "{new_events}");
    }

    #[test]
    fn same_seed_same_traffic() {
        let (mut a, mut b) = (Traffic::new(spec()), Traffic::new(spec()));
        let (mut x, mut y) = (Event::default(), Event::default());
        while a.next_into(&mut x) {
            assert!(b.next_into(&mut y));
            assert_eq!((&x.id, &x.payload, x.expect), (&y.id, &y.payload, y.expect));
        }
    }

    #[test]
    fn rates_and_payloads_are_as_specified() {
        let mut t = Traffic::new(spec());
        let mut ev = Event::default();
        let mut seen = std::collections::HashMap::new();
        let (mut dups, mut mism) = (0, 0);
        while t.next_into(&mut ev) {
            let payload: serde_json::Value = serde_json::from_slice(&ev.payload).expect("json");
            assert!(payload.get("order_id").is_some());
            assert_eq!(payload["type"], "OrderPlaced");
            match ev.expect {
                Some(Expect::New) => {
                    assert!(seen.insert(ev.id.clone(), ev.payload.clone()).is_none())
                }
                Some(Expect::Duplicate) => {
                    dups += 1;
                    assert_eq!(seen.get(&ev.id), Some(&ev.payload));
                }
                Some(Expect::Mismatch) => {
                    mism += 1;
                    assert_ne!(seen.get(&ev.id), Some(&ev.payload));
                }
                None => unreachable!(),
            }
        }
        assert!((900..1100).contains(&dups), "{dups}");
        assert!((50..150).contains(&mism), "{mism}");
        assert_eq!(t.unique() as usize, seen.len());
    }
}
