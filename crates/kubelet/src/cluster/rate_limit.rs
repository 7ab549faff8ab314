//! The client-side rate limit of the node's API writes (the kubelet's
//! `--kube-api-qps` and `--kube-api-burst`): a token bucket holding up to
//! `burst` tokens, refilled at `qps` a second; each request takes one, and
//! waits for it when the bucket is empty.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Upstream's default `--kube-api-qps`.
pub const DEFAULT_QPS: f64 = 50.0;
/// Upstream's default `--kube-api-burst`.
pub const DEFAULT_BURST: u32 = 100;

/// A token bucket.
#[derive(Debug)]
pub struct RateLimiter {
    qps: f64,
    burst: f64,
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// A full bucket of `burst` tokens refilled at `qps` a second (a `qps`
    /// of 0 or less: no limit).
    pub fn new(qps: f64, burst: u32) -> RateLimiter {
        let burst = f64::from(burst.max(1));
        RateLimiter { qps, burst, bucket: Mutex::new((burst, Instant::now())) }
    }

    /// Takes a token, waiting until there is one.
    pub async fn acquire(&self) {
        if self.qps <= 0.0 {
            return;
        }
        loop {
            let wait = {
                let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let (tokens, last) = *bucket;
                let tokens = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.qps).min(self.burst);
                if tokens >= 1.0 {
                    *bucket = (tokens - 1.0, now);
                    return;
                }
                *bucket = (tokens, now);
                Duration::from_secs_f64((1.0 - tokens) / self.qps)
            };
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under a paused clock: the burst goes at once, then one request per
    /// 1/qps.
    #[tokio::test(start_paused = true)]
    async fn the_burst_goes_at_once_then_qps() {
        let limiter = RateLimiter::new(10.0, 5);
        let start = Instant::now();
        for _ in 0..5 {
            limiter.acquire().await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        for _ in 0..10 {
            limiter.acquire().await;
        }
        let elapsed = start.elapsed().as_secs_f64();
        assert!((0.99..1.01).contains(&elapsed), "10 more at 10/s take a second: {elapsed}");
    }
}
