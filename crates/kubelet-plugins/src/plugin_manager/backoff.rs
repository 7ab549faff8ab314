//! Per-socket exponential backoff for failed operations.
//!
//! Upstream's rule: the first failure waits the initial delay (500 ms), each
//! further failure doubles it up to a cap (2 min 2 s), a success resets it.

use std::time::Duration;

/// Backoff state for one socket path.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    last: Option<Duration>,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max, last: None }
    }

    /// Records a failure and returns how long to wait before the next try.
    pub(crate) fn fail(&mut self) -> Duration {
        let next = match self.last {
            None => self.initial,
            Some(last) => last.saturating_mul(2).min(self.max),
        };
        self.last = Some(next);
        next
    }

    /// Records a success (or a new socket instance): the next failure starts over.
    pub(crate) fn reset(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_500ms_to_the_cap_and_reset_on_success() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(122));
        let delays: Vec<_> = (0..11).map(|_| b.fail().as_millis()).collect();
        assert_eq!(delays, vec![500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 122000, 122000, 122000]);
        b.reset();
        assert_eq!(b.fail(), Duration::from_millis(500));
    }
}
