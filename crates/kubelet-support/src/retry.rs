//! The node's retry backoff: one type for every retried call (API writes
//! and watches, cluster tasks, volume teardown, the kubeconfig, binding
//! `kubelet.sock`),
//! built on `backon`'s exponential backoff: the delay doubles from `initial`
//! up to `max`, and each delay gets up to as much again at random (jitter),
//! so that many things failing together do not retry together. A success
//! resets it.
//!
//! Two schedules stay their own, because upstream fixes them and tests
//! depend on them: the plugin registration executor's per-socket backoff
//! (500 ms doubling to 2 min 2 s, as upstream's operation executor) and a
//! container's restart backoff (10 s doubling to 5 min, reset after 10 min
//! of running: CrashLoopBackOff, which users read).

use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};

/// Doubling, jittered delays between retries.
#[derive(Debug)]
pub struct RetryBackoff {
    builder: ExponentialBuilder,
    delays: ExponentialBackoff,
    max: Duration,
    failures: usize,
}

impl RetryBackoff {
    /// From `initial`, doubling up to `max` (each delay plus up to as much
    /// again at random).
    pub fn new(initial: Duration, max: Duration) -> RetryBackoff {
        let builder = ExponentialBuilder::new()
            .with_min_delay(initial)
            .with_max_delay(max.max(initial))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        RetryBackoff { delays: builder.build(), builder, max, failures: 0 }
    }

    /// The backoff of an API watch that failed: from 500 ms, doubling to
    /// 30 s, jittered (kube's watcher retries the request; this paces a
    /// failing API server instead of asking it twice a second forever).
    pub fn for_watches() -> RetryBackoff {
        RetryBackoff::new(Duration::from_millis(500), Duration::from_secs(30))
    }

    /// The delay before the next attempt, after a failure.
    pub fn next_delay(&mut self) -> Duration {
        self.failures += 1;
        self.delays.next().unwrap_or(self.max)
    }

    /// How many failures since the last success.
    pub fn failures(&self) -> usize {
        self.failures
    }

    /// After a success: the next failure waits the first delay again.
    pub fn reset(&mut self) {
        self.delays = self.builder.build();
        self.failures = 0;
    }
}

/// `period` plus up to `factor` of it again at random, as upstream's
/// `wait.Jitter`: periodic calls of many nodes (Lease renewals) that start
/// together drift apart instead of arriving together.
pub fn jittered(period: Duration, factor: f64) -> Duration {
    use std::hash::{BuildHasher as _, Hasher as _};
    // Each `RandomState` is keyed anew: its hash of nothing is a fresh
    // random number.
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    period + period.mul_f64(factor.max(0.0) * (random % 1_000_000) as f64 / 1_000_000.0)
}

impl Clone for RetryBackoff {
    /// The same schedule at the same step (its random draws are new).
    fn clone(&self) -> Self {
        let mut delays = self.builder.build();
        for _ in 0..self.failures {
            delays.next();
        }
        RetryBackoff { builder: self.builder, delays, max: self.max, failures: self.failures }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_to_the_cap_with_jitter_and_reset_after_a_success() {
        let (initial, max) = (Duration::from_millis(100), Duration::from_secs(1));
        let mut backoff = RetryBackoff::new(initial, max);
        let mut base = initial;
        for _ in 0..8 {
            let delay = backoff.next_delay();
            assert!(delay >= base && delay < base * 2, "{delay:?} for a base of {base:?}");
            base = (base * 2).min(max);
        }
        assert_eq!(backoff.failures(), 8);
        let copy = backoff.clone();
        assert_eq!(copy.failures(), 8);
        backoff.reset();
        let delay = backoff.next_delay();
        assert!(delay >= initial && delay < initial * 2, "{delay:?}");
    }

    #[test]
    fn jittered_periods_stay_within_the_factor_and_differ() {
        let period = Duration::from_secs(10);
        let drawn: Vec<Duration> = (0..50).map(|_| jittered(period, 0.04)).collect();
        assert!(drawn.iter().all(|d| *d >= period && *d < period.mul_f64(1.04)), "{drawn:?}");
        assert!(drawn.iter().any(|d| *d != drawn[0]), "all the same: {drawn:?}");
        assert_eq!(jittered(period, 0.0), period);
    }

    #[test]
    fn jitter_spreads_retries() {
        let delays: std::collections::BTreeSet<Duration> = (0..20)
            .map(|_| RetryBackoff::new(Duration::from_millis(100), Duration::from_secs(1)).next_delay())
            .collect();
        assert!(delays.len() > 1, "twenty first delays are not all the same: {delays:?}");
    }
}
