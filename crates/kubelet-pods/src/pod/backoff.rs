//! Container restart backoff, as upstream: 10 s, doubling, capped at 5 min,
//! forgotten once the container has run cleanly for 10 min.

use std::time::Duration;

use tokio::time::Instant;

/// The backoff settings (upstream's by default; tests shorten them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffConfig {
    /// The first delay.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// A container that ran this long starts over at `initial`.
    pub reset_after: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
            reset_after: Duration::from_secs(600),
        }
    }
}

impl BackoffConfig {
    /// A pod's volume preparation: 0.5 s, doubling, capped at 2 min, never
    /// forgotten while the pod waits.
    pub const VOLUMES: BackoffConfig = BackoffConfig {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(120),
        reset_after: Duration::MAX,
    };
}

/// One container's (or one image's) backoff state.
#[derive(Clone, Debug, Default)]
pub(crate) struct Backoff {
    delay: Option<Duration>,
    until: Option<Instant>,
}

impl Backoff {
    /// Records a failure (or an exit to restart from) at `now` after the
    /// container ran for `ran` (zero if it never ran); returns the delay
    /// before the next start.
    pub(crate) fn fail(&mut self, config: &BackoffConfig, ran: Duration, now: Instant) -> Duration {
        let delay = match self.delay {
            Some(previous) if ran < config.reset_after => (previous * 2).min(config.max),
            _ => config.initial,
        };
        self.delay = Some(delay);
        self.until = Some(now + delay);
        delay
    }

    /// When the next start may happen, if backing off.
    pub(crate) fn until(&self) -> Option<Instant> {
        self.until
    }

    /// Whether a start may happen at `now`.
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|until| until <= now)
    }

    /// Clears the pending wait (the delay is kept to double next time).
    pub(crate) fn waited(&mut self) {
        self.until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_to_the_cap_and_reset_after_a_long_run() {
        let config = BackoffConfig::default();
        let now = Instant::now();
        let mut backoff = Backoff::default();
        let delays: Vec<u64> = (0..7).map(|_| backoff.fail(&config, Duration::from_secs(1), now).as_secs()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(backoff.fail(&config, Duration::from_secs(600), now), Duration::from_secs(10));
        assert!(!backoff.ready(now));
        assert!(backoff.ready(now + Duration::from_secs(10)));
    }
}
