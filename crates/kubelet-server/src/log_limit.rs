//! Warnings that strangers can trigger (refused connections, failed TLS
//! handshakes, refused plugin sockets) are rate-limited: the first is
//! logged at once, then at most one per period, each saying how many were
//! left out since the last. The counts in `/metrics` stay exact.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often a limited warning is logged at most.
pub(crate) const PERIOD: Duration = Duration::from_secs(60);

/// One kind of limited warning.
pub(crate) struct LogLimiter {
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimiter {
    pub(crate) const fn new() -> Self {
        LogLimiter { state: Mutex::new((None, 0)) }
    }

    /// Whether to log now: `Some(left_out)` (how many were not logged since
    /// the last one) when the period has passed, else `None` (and this one
    /// counts as left out).
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now(), PERIOD)
    }

    fn admit_at(&self, now: Instant, period: Duration) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match state.0 {
            Some(last) if now.saturating_duration_since(last) < period => {
                state.1 += 1;
                None
            }
            _ => {
                let left_out = std::mem::take(&mut state.1);
                state.0 = Some(now);
                Some(left_out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_logged_then_one_per_period_with_the_count_left_out() {
        let limiter = LogLimiter::new();
        let start = Instant::now();
        let period = Duration::from_secs(60);
        assert_eq!(limiter.admit_at(start, period), Some(0));
        assert_eq!(limiter.admit_at(start + Duration::from_secs(1), period), None);
        assert_eq!(limiter.admit_at(start + Duration::from_secs(59), period), None);
        assert_eq!(limiter.admit_at(start + Duration::from_secs(60), period), Some(2));
        assert_eq!(limiter.admit_at(start + Duration::from_secs(61), period), None);
    }
}
