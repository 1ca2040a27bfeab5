//! Whether each running source can do its work, for `/readyz`: a source that cannot reach
//! its broker makes the engine not ready once that has lasted past a grace period, and the
//! answer says which source and why. Process-wide, like the metrics recorder: a source
//! reports from its own threads (librdkafka's callbacks) without a handle to the server.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a source may be unable to work before `/readyz` says so: a broker restart or
/// a leader election is shorter, and a readiness probe that flaps on them does harm.
pub const GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
struct State {
    /// `None`: working; `Some`: why not, and since when.
    down: Option<(String, Instant)>,
}

static SOURCES: Mutex<BTreeMap<String, State>> = Mutex::new(BTreeMap::new());

fn sources() -> std::sync::MutexGuard<'static, BTreeMap<String, State>> {
    SOURCES.lock().unwrap_or_else(|p| p.into_inner())
}

/// A source starts: not working until it says it is (its first broker contact).
pub fn starting(name: &str, why: &str) {
    sources().insert(
        name.to_string(),
        State {
            down: Some((why.to_string(), Instant::now())),
        },
    );
}

/// The source can do its work.
pub fn up(name: &str) {
    if let Some(s) = sources().get_mut(name) {
        s.down = None;
    }
}

/// The source cannot do its work, and why; the time it started failing is kept.
pub fn down(name: &str, why: &str) {
    if let Some(s) = sources().get_mut(name) {
        match &mut s.down {
            Some((reason, _)) => *reason = why.to_string(),
            None => s.down = Some((why.to_string(), Instant::now())),
        }
    }
}

/// The source stopped (its subscription ended): it no longer counts.
pub fn stopped(name: &str) {
    sources().remove(name);
}

/// Every source that has been unable to work for longer than `grace`, with its reason.
pub fn failing(grace: Duration) -> Vec<(String, String)> {
    sources()
        .iter()
        .filter_map(|(name, s)| {
            let (why, since) = s.down.as_ref()?;
            (since.elapsed() >= grace).then(|| {
                let secs = since.elapsed().as_secs();
                (name.clone(), format!("{why} (for {secs} s)"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_fails_readiness_only_past_the_grace_period() {
        let name = "test-source-grace";
        starting(name, "no broker contact yet");
        assert!(failing(Duration::from_secs(60))
            .iter()
            .all(|(n, _)| n != name));
        let now: Vec<_> = failing(Duration::ZERO);
        let (_, why) = now.iter().find(|(n, _)| n == name).unwrap();
        assert!(why.starts_with("no broker contact yet"), "{why}");
        up(name);
        assert!(failing(Duration::ZERO).iter().all(|(n, _)| n != name));
        down(name, "all brokers down");
        down(name, "all brokers down: connection refused");
        let (_, why) = failing(Duration::ZERO)
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap();
        assert!(
            why.starts_with("all brokers down: connection refused"),
            "{why}"
        );
        stopped(name);
        assert!(failing(Duration::ZERO).iter().all(|(n, _)| n != name));
    }
}
