//! Which durable deliveries a binding acknowledges now, and how: the run at the front of
//! the channel's unsettled deliveries with one `multiple` ack; a durable delivery behind one
//! still in flight waits up to [`ACK_HOLD`] to join that run (the other shard's commit is
//! usually a batch away), and is acknowledged alone when it waited, when half of the
//! window is unsettled, or at a stop. Each ack is a frame the server handles: acknowledging
//! every such delivery alone at once made the claims-only engine slower than the handler
//! path (`docs/rabbitmq.md`, "Throughput").

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long a durable message behind one still in flight waits to be acknowledged with
/// the run at the front before it is acknowledged alone.
pub(super) const ACK_HOLD: Duration = Duration::from_millis(50);

/// Settlement of one unsettled delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pending {
    /// Submitted; its outcome is not durable yet.
    InFlight,
    /// Durable; waiting to be acknowledged with the run it belongs to.
    Durable,
}

/// When durable messages that waited since `since` behind one in flight are acknowledged
/// alone.
pub(super) async fn held_until(since: Option<Instant>) {
    if let Some(since) = since {
        tokio::time::sleep_until((since + ACK_HOLD).into()).await;
    }
}

/// The acknowledgements to send now for a binding's unsettled deliveries.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct AckPlan {
    /// The run of durable deliveries at the front (one `basic.ack`, `multiple` when it
    /// holds more than one).
    pub(crate) front: Vec<u64>,
    /// Durable deliveries behind one still in flight, acknowledged one by one.
    pub(crate) alone: Vec<u64>,
    /// Durable deliveries behind one still in flight left to wait for the front.
    pub(crate) held: usize,
}

/// What to acknowledge of `pending`: the durable run at the front always; the durable
/// deliveries behind an unfinished one only when `hurry` (they waited [`ACK_HOLD`], or
/// the binding stops) or when what stays unsettled holds half of `window` (so the server
/// keeps sending). Otherwise they wait to join the front run: one frame for all of them
/// once the delivery before them is durable.
pub(super) fn plan_acks(pending: &BTreeMap<u64, Pending>, window: usize, hurry: bool) -> AckPlan {
    let front: Vec<u64> = pending
        .iter()
        .take_while(|(_, p)| **p == Pending::Durable)
        .map(|(tag, _)| *tag)
        .collect();
    let behind = pending
        .iter()
        .skip(front.len())
        .filter(|(_, p)| **p == Pending::Durable)
        .map(|(tag, _)| *tag);
    let unsettled = pending.len() - front.len();
    if hurry || unsettled >= window.div_ceil(2) {
        AckPlan {
            front,
            alone: behind.collect(),
            held: 0,
        }
    } else {
        AckPlan {
            front,
            alone: Vec::new(),
            held: behind.count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(states: &[(u64, Pending)]) -> BTreeMap<u64, Pending> {
        states.iter().copied().collect()
    }

    /// One shard's commit lands before the other's: the durable deliveries behind the
    /// unfinished one wait and join the front run, one `multiple` ack for all, instead
    /// of a frame each.
    #[test]
    fn durable_deliveries_behind_an_unfinished_one_wait_to_join_the_front_run() {
        use Pending::{Durable, InFlight};
        let mut p = pending(&[
            (1, Durable),
            (2, InFlight),
            (3, Durable),
            (4, Durable),
            (5, InFlight),
            (6, Durable),
        ]);
        let plan = plan_acks(&p, 1024, false);
        assert_eq!(
            plan,
            AckPlan {
                front: vec![1],
                alone: vec![],
                held: 3,
            }
        );
        p.remove(&1);
        p.insert(2, Durable);
        p.insert(5, Durable);
        let plan = plan_acks(&p, 1024, false);
        assert_eq!(plan.front, vec![2, 3, 4, 5, 6], "one frame for all five");
        assert!(plan.alone.is_empty());
        assert_eq!(plan.held, 0);
    }

    /// A delivery that stays unfinished (a retry's backoff, a slow handler) does not hold
    /// the ones behind it for long, nor at a stop, nor past half of the window.
    #[test]
    fn held_deliveries_are_acknowledged_alone_when_they_waited_or_the_window_fills() {
        use Pending::{Durable, InFlight};
        let p = pending(&[(7, InFlight), (8, Durable), (9, Durable), (10, InFlight)]);
        let hurried = plan_acks(&p, 1024, true);
        assert_eq!(
            hurried,
            AckPlan {
                front: vec![],
                alone: vec![8, 9],
                held: 0,
            }
        );
        // Four unsettled in a window of eight: half held, so the server could stall.
        assert_eq!(plan_acks(&p, 8, false).alone, vec![8, 9]);
        assert_eq!(plan_acks(&p, 9, false).held, 2);
        assert!(plan_acks(&BTreeMap::new(), 8, true).front.is_empty());
    }
}
