//! Model-based test: a seeded random mix of new ids, redeliveries, reused ids with other
//! payloads, several subscribers (one with sliding TTL), clock jumps past the TTL, forced
//! sealing and merging, forgotten claims, and restarts — checked after every step against a `BTreeMap`
//! reference. A failure names its seed; rerun one with `DEDUPD_MODEL_SEED=N`.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::unbounded;
use dedupd::clock::ManualClock;
use dedupd::config::{Config, SubscriberConfig};
use dedupd::envelope::key_hash;
use dedupd::ledger::{Done, Job, Ledger, Outcome};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const TTL_MS: u64 = 60_000;
const SUBSCRIBERS: [&str; 3] = ["orders", "billing", "audit"];

fn config() -> Config {
    let mut c = Config {
        allow_unknown_subscribers: false,
        ..Config::default()
    };
    c.ledger.shards = std::num::NonZeroUsize::new(2);
    // Tiny generations so sealing, merging and expiry all happen within a short test.
    c.ledger.generation_max_claims = std::num::NonZeroUsize::new(40).unwrap();
    c.ledger.merge_trigger_generations = std::num::NonZeroUsize::new(2).unwrap();
    c.ledger.merge_max_claims = std::num::NonZeroUsize::new(200).unwrap();
    c.ledger.generation_max_age = Duration::from_secs(20);
    c.subscribers = SUBSCRIBERS
        .iter()
        .map(|name| SubscriberConfig {
            name: name.to_string(),
            ttl: Some(Duration::from_millis(TTL_MS)),
            sliding_ttl: Some(*name == "billing"),
            ..Default::default()
        })
        .collect();
    c
}

/// The reference: newest claim per (subscriber, id).
#[derive(Default)]
struct Model {
    claims: BTreeMap<(usize, u64), (u64, u64)>,
}

impl Model {
    fn deliver(&mut self, sub: usize, id: u64, fp: u64, now: u64) -> Outcome {
        match self.claims.get_mut(&(sub, id)) {
            Some((stored, expires)) if *expires > now => {
                if *stored == fp {
                    if SUBSCRIBERS[sub] == "billing" {
                        *expires = now + TTL_MS;
                    }
                    Outcome::Duplicate
                } else {
                    Outcome::Quarantined {
                        stored_fingerprint: *stored,
                    }
                }
            }
            _ => {
                self.claims.insert((sub, id), (fp, now + TTL_MS));
                Outcome::Processed
            }
        }
    }

    /// `forget`: the live claim goes away; true if there was one.
    fn forget(&mut self, sub: usize, id: u64, now: u64) -> bool {
        let live = self.live(sub, id, now).is_some();
        if live {
            self.claims.remove(&(sub, id));
        }
        live
    }

    fn live(&self, sub: usize, id: u64, now: u64) -> Option<u64> {
        self.claims
            .get(&(sub, id))
            .filter(|(_, e)| *e > now)
            .map(|(fp, _)| *fp)
    }
}

fn id_text(id: u64) -> String {
    format!("evt-{id}")
}

/// Sealing, merging and expiry work done during a run, so the test can prove it covered them.
#[derive(Default, Debug)]
struct Coverage {
    seals: u64,
    merges: u64,
    dropped: u64,
    restarts: u64,
    forgets: u64,
}

fn add_metrics(cov: &mut Coverage, l: &Ledger) {
    for m in l.metrics() {
        cov.seals += m.seals;
        cov.merges += m.merges;
        cov.dropped += m.dropped_generations;
    }
}

fn run_seed(seed: u64, steps: usize) -> Coverage {
    let mut cov = Coverage::default();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let config = config();
    let mut ledger = Some(Ledger::open(dir.path(), &config, Arc::new(clock.clone())).unwrap());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = Model::default();
    let mut next_id = 0u64;
    let mut seq = 0u64;
    let mut restarts = 0;
    for step in 0..steps {
        let ctx = format!("seed {seed}, step {step}");
        let l = ledger.as_ref().unwrap();
        match rng.random_range(0..100) {
            // A batch of deliveries submitted together (same-batch duplicates included).
            0..=79 => {
                let n = rng.random_range(1..30);
                let (tx, rx) = unbounded::<Vec<Done>>();
                let mut expected = Vec::new();
                let now = clock.now();
                let mut jobs_by_shard: BTreeMap<usize, Vec<Job>> = BTreeMap::new();
                for _ in 0..n {
                    let sub = rng.random_range(0..SUBSCRIBERS.len());
                    let id = if next_id == 0 || rng.random_bool(0.45) {
                        next_id += 1;
                        next_id - 1
                    } else {
                        rng.random_range(0..next_id)
                    };
                    // Mostly the id's own payload; sometimes another one.
                    let fp = if rng.random_bool(0.1) {
                        id * 1000 + rng.random_range(1..3)
                    } else {
                        id * 1000
                    };
                    expected.push((seq, model.deliver(sub, id, fp, now)));
                    let text = id_text(id);
                    let key = key_hash(text.as_bytes());
                    let sub_id = l.subscriber(SUBSCRIBERS[sub]).unwrap().id;
                    let job = Job::new(seq, sub_id, key, fp, &text, b"", tx.clone());
                    jobs_by_shard.entry(l.route(key)).or_default().push(job);
                    seq += 1;
                }
                for (shard, jobs) in jobs_by_shard {
                    l.submit(shard, jobs).unwrap();
                }
                drop(tx);
                let mut got: Vec<Done> = rx.iter().flatten().collect();
                got.sort_by_key(|d| d.seq);
                let got: Vec<(u64, Outcome)> =
                    got.into_iter().map(|d| (d.seq, d.outcome)).collect();
                assert_eq!(got, expected, "{ctx}");
            }
            // Time passes, sometimes past the TTL.
            80..=87 => clock.advance(rng.random_range(1_000..(TTL_MS * 3 / 2))),
            // Seal everything now and finish merging and expiry.
            88..=92 => l.maintain(rng.random_bool(0.5)).unwrap(),
            // Restart.
            93..=96 => {
                add_metrics(&mut cov, ledger.as_ref().unwrap());
                ledger.take().unwrap().close().unwrap();
                ledger = Some(Ledger::open(dir.path(), &config, Arc::new(clock.clone())).unwrap());
                restarts += 1;
            }
            // An operator forgets a few claims (live, expired, forgotten or never seen).
            97 => {
                let now = clock.now();
                for _ in 0..5 {
                    let sub = rng.random_range(0..SUBSCRIBERS.len());
                    let id = rng.random_range(0..next_id + 2);
                    let got = l
                        .forget(SUBSCRIBERS[sub], key_hash(id_text(id).as_bytes()))
                        .unwrap();
                    assert_eq!(got, model.forget(sub, id, now), "{ctx}: forget {sub}/{id}");
                    cov.forgets += u64::from(got);
                }
            }
            // Point lookups agree with the model on liveness and fingerprint.
            _ => {
                let now = clock.now();
                for _ in 0..20 {
                    if next_id == 0 {
                        break;
                    }
                    let sub = rng.random_range(0..SUBSCRIBERS.len());
                    let id = rng.random_range(0..next_id);
                    let got = l
                        .lookup(SUBSCRIBERS[sub], key_hash(id_text(id).as_bytes()))
                        .unwrap()
                        .filter(|c| c.is_live(now))
                        .map(|c| c.fingerprint);
                    assert_eq!(got, model.live(sub, id, now), "{ctx}: lookup {sub}/{id}");
                }
            }
        }
    }
    add_metrics(&mut cov, ledger.as_ref().unwrap());
    ledger.take().unwrap().close().unwrap();
    cov.restarts = restarts;
    cov
}

trait Now {
    fn now(&self) -> u64;
    fn advance(&self, ms: u64);
}

impl Now for ManualClock {
    fn now(&self) -> u64 {
        use dedupd::clock::Clock;
        self.now_ms()
    }
    fn advance(&self, ms: u64) {
        self.advance_ms(ms);
    }
}

#[test]
fn engine_matches_reference_model() {
    if let Ok(seed) = std::env::var("DEDUPD_MODEL_SEED") {
        run_seed(
            seed.parse().expect("DEDUPD_MODEL_SEED must be a number"),
            600,
        );
        return;
    }
    // `scripts/reliability` runs other seeds with DEDUPD_RELIABILITY_SEED=N.
    let base = std::env::var("DEDUPD_RELIABILITY_SEED")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 6;
    let mut total = Coverage::default();
    for seed in base..base + 6 {
        let c = run_seed(seed, 600);
        total.seals += c.seals;
        total.merges += c.merges;
        total.dropped += c.dropped;
        total.restarts += c.restarts;
        total.forgets += c.forgets;
    }
    eprintln!("model coverage: {total:?}");
    // The mix must have exercised every generation transition, or it proves little.
    assert!(total.seals > 10, "{total:?}");
    assert!(total.merges > 3, "{total:?}");
    assert!(total.dropped > 3, "{total:?}");
    assert!(total.restarts > 10, "{total:?}");
    assert!(total.forgets > 10, "{total:?}");
}
