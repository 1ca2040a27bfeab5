//! What the decoder fuzz targets share (issue 14): how many inputs a target runs, its
//! seed, and structure-aware mutations of valid encodings.
//!
//! Every decoder of bytes that come from outside the process (input lines, Kafka records,
//! config files) or from disk (records, filters, log rows, state blocks) has a target
//! next to it, built on [`run`]. Each target feeds arbitrary bytes and mutations of valid
//! encodings (bits flipped, bytes set, inserted, removed, length fields set to edge
//! values, truncation) and checks that decoding never panics, never allocates more than
//! the input can justify, and that a valid encoding round-trips. Properties, not just "no
//! panic": a decoded value re-encodes to what was read, or refuses it.
//!
//! `cargo fuzz` needs nightly Rust and cargo-fuzz, which CI does not have: these are
//! proptest properties run at scale. `cargo test` runs each with a few hundred to a few
//! thousand inputs (about 3 s for all of them); `DEDUPD_FUZZ_CASES=N` runs every target
//! with `N` inputs instead (the long mode of `scripts/reliability`), and
//! `DEDUPD_FUZZ_SEED` picks another seed. Each target prints
//! `fuzz <name>: <n> executions, <m> decoded` to stderr (`decoded`: inputs that got past
//! the decoder); a failure panics with the shrunk input and the seed that replays it, and
//! becomes a named regression test beside the decoder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

/// Inputs per target when set (overrides every target's default).
pub(crate) const CASES_VAR: &str = "DEDUPD_FUZZ_CASES";
/// Seed of every target when set (a number); each target mixes in its name.
pub(crate) const SEED_VAR: &str = "DEDUPD_FUZZ_SEED";
/// The seed `cargo test` uses, so a run is repeatable.
const DEFAULT_SEED: u64 = 0x5eed_f022;
thread_local! {
    /// Inputs of the running target that decoded (see [`decoded`]).
    static DECODED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts an input that decoded, so a target shows it got past the first check (the
/// runner calls the test on this thread).
pub(crate) fn decoded() {
    DECODED.with(|d| d.set(d.get() + 1));
}

/// One decode of a few kilobytes takes microseconds: far longer is a hang.
const SLOW_EXECUTION: Duration = Duration::from_secs(10);

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v:?} is not a number"),
    }
}

/// Runs `test` on `default_cases` inputs from `strategy` (or `DEDUPD_FUZZ_CASES`), and
/// panics with the shrunk failing input and the seed if one fails or panics.
pub(crate) fn run<S>(
    name: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let cases = env_u64(CASES_VAR).map_or(default_cases, |n| n.clamp(1, u32::MAX.into()) as u32);
    let seed = env_u64(SEED_VAR).unwrap_or(DEFAULT_SEED);
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..24].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(name.as_bytes()).to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let executions = AtomicU64::new(0);
    DECODED.with(|d| d.set(0));
    let started = Instant::now();
    let result = runner.run(&strategy, |input| {
        executions.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        test(input)?;
        let took = t.elapsed();
        prop_assert!(took < SLOW_EXECUTION, "one execution took {took:?}");
        Ok(())
    });
    let n = executions.load(Ordering::Relaxed);
    // Targets of valid inputs only (round trips) count nothing as decoded.
    let decoded = match DECODED.with(|d| d.get()) {
        0 => String::new(),
        d => format!(", {d} decoded"),
    };
    eprintln!(
        "fuzz {name}: {n} executions{decoded} ({cases} cases, seed {seed}) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, input)) => panic!(
            "fuzz {name} failed (replay: {SEED_VAR}={seed} {CASES_VAR}={cases}): {why}\nminimal input: {input:?}"
        ),
        Err(TestError::Abort(why)) => panic!("fuzz {name} aborted: {why}"),
    }
}

/// Arbitrary bytes, up to `max` of them.
pub(crate) fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=max)
}

/// A position in an encoding, taken modulo its length (shrinks towards the start).
#[derive(Debug, Clone, Copy)]
pub(crate) struct At(pub(crate) usize);

fn at() -> impl Strategy<Value = At> {
    (0usize..1 << 16).prop_map(At)
}

/// One change to an encoding.
#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// One bit flipped.
    Flip(At, u8),
    /// One byte set.
    Set(At, u8),
    /// Bytes inserted.
    Insert(At, Vec<u8>),
    /// Up to `n` bytes removed.
    Remove(At, usize),
    /// Cut at a position.
    Truncate(At),
    /// A little-endian field of `width` bytes set to an edge value: what a damaged length
    /// or count looks like.
    Word(At, u8, u64),
    /// A slice copied over another place (a repeated or shifted entry).
    Copy(At, At, usize),
}

/// Values a length, count or offset field is most likely to break on.
fn edge_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(0x7f),
        Just(0x80),
        Just(0xff),
        Just(0xffff),
        Just(0x7fff_ffff),
        Just(0x8000_0000),
        Just(u64::from(u32::MAX)),
        Just(1 << 32),
        Just(1 << 62),
        Just(u64::MAX),
        0u64..4096,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (at(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (at(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (at(), bytes(9)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (at(), 1usize..17).prop_map(|(i, n)| Mutation::Remove(i, n)),
        at().prop_map(Mutation::Truncate),
        (at(), prop::sample::select(vec![1u8, 2, 4, 8]), edge_value())
            .prop_map(|(i, w, v)| Mutation::Word(i, w, v)),
        (at(), at(), 1usize..49).prop_map(|(a, b, n)| Mutation::Copy(a, b, n)),
    ]
}

/// Applies `m` to `b`; a mutation that does not fit (an empty input) changes nothing.
pub(crate) fn apply(b: &mut Vec<u8>, m: &Mutation) {
    let len = b.len();
    match m {
        Mutation::Insert(i, add) => {
            let at = i.0 % (len + 1);
            b.splice(at..at, add.iter().copied());
        }
        _ if len == 0 => {}
        Mutation::Flip(i, bit) => b[i.0 % len] ^= 1 << bit,
        Mutation::Set(i, v) => b[i.0 % len] = *v,
        Mutation::Remove(i, n) => {
            let at = i.0 % len;
            b.drain(at..(at + n).min(len));
        }
        Mutation::Truncate(i) => b.truncate(i.0 % len),
        Mutation::Word(i, width, v) => {
            let at = i.0 % len;
            let end = (at + usize::from(*width)).min(len);
            b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
        }
        Mutation::Copy(from, to, n) => {
            let from = from.0 % len;
            let n = (*n).min(len - from);
            let to = to.0 % len;
            let n = n.min(len - to);
            b.copy_within(from..from + n, to);
        }
    }
}

/// A valid encoding from `valid`, then one to six mutations.
pub(crate) fn mutated(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    (valid, prop::collection::vec(mutation(), 1..=6)).prop_map(|(mut b, ms)| {
        for m in &ms {
            apply(&mut b, m);
        }
        b
    })
}

/// Arbitrary bytes half the time, a mutated valid encoding the other half.
pub(crate) fn hostile(
    max: usize,
    valid: impl Strategy<Value = Vec<u8>>,
) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![bytes(max), mutated(valid)]
}

/// Arbitrary JSON: numbers of any length and precision (kept as written), strings with
/// any characters (NUL too), nested arrays and objects with the member names key sources
/// look for.
pub(crate) fn json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "-?(0|[1-9][0-9]{0,30})(\\.[0-9]{1,12})?([eE][+-]?[0-9]{1,4})?"
            .prop_map(|t| serde_json::from_str(&t).unwrap_or(Value::Null)),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("id|source|order_id|a|b|.{0,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_in_bounds_and_change_lengths_as_said() {
        let mut b = vec![1u8, 2, 3, 4, 5];
        apply(&mut b, &Mutation::Word(At(4), 8, u64::MAX));
        assert_eq!(b, [1, 2, 3, 4, 0xff]);
        apply(&mut b, &Mutation::Remove(At(3), 16));
        assert_eq!(b, [1, 2, 3]);
        apply(&mut b, &Mutation::Insert(At(3), vec![9]));
        assert_eq!(b, [1, 2, 3, 9]);
        apply(&mut b, &Mutation::Copy(At(0), At(2), 40));
        assert_eq!(b, [1, 2, 1, 2]);
        let mut empty = Vec::new();
        apply(&mut empty, &Mutation::Truncate(At(0)));
        apply(&mut empty, &Mutation::Flip(At(0), 3));
        assert!(empty.is_empty());
    }
}
