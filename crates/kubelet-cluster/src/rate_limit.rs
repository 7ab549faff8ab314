//! The client-side rate limit of the node's API requests (the kubelet's
//! `--kube-api-qps` and `--kube-api-burst`): a token bucket holding up to
//! `burst` tokens, refilled at `qps` a second; each request takes one, and
//! waits for it when the bucket is empty.
//!
//! [`RateLimitLayer`] puts it under a kube client, so that every request
//! the client sends (reads, writes, the start of each watch) is counted, as
//! client-go's limiter counts them; the pod status writer also has one of
//! its own for clients it did not build.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

/// Upstream's default `--kube-api-qps`.
pub const DEFAULT_QPS: f64 = 50.0;
/// Upstream's default `--kube-api-burst`.
pub const DEFAULT_BURST: u32 = 100;

/// A token bucket.
#[derive(Debug)]
pub(crate) struct RateLimiter {
    qps: f64,
    burst: f64,
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// A full bucket of `burst` tokens refilled at `qps` a second (a `qps`
    /// of 0 or less: no limit).
    pub(crate) fn new(qps: f64, burst: u32) -> RateLimiter {
        let burst = f64::from(burst.max(1));
        RateLimiter { qps, burst, bucket: Mutex::new((burst, Instant::now())) }
    }

    /// Takes a token, waiting until there is one.
    pub(crate) async fn acquire(&self) {
        while let Err(wait) = self.try_acquire() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Takes a token if there is one; else how long until there is.
    pub(crate) fn try_acquire(&self) -> Result<(), Duration> {
        if self.qps <= 0.0 {
            return Ok(());
        }
        let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let (tokens, last) = *bucket;
        let tokens = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.qps).min(self.burst);
        if tokens >= 1.0 {
            *bucket = (tokens - 1.0, now);
            return Ok(());
        }
        *bucket = (tokens, now);
        Err(Duration::from_secs_f64((1.0 - tokens) / self.qps))
    }
}

/// A tower layer that makes every request wait for a token of a shared
/// [`RateLimiter`]: `kube::client::ClientBuilder::with_layer`.
#[derive(Clone, Debug)]
pub(crate) struct RateLimitLayer {
    limiter: Arc<RateLimiter>,
}

impl RateLimitLayer {
    /// Requests at `qps` a second on average, `burst` at once (`qps` of 0
    /// or less: no limit).
    pub(crate) fn new(qps: f64, burst: u32) -> RateLimitLayer {
        RateLimitLayer { limiter: Arc::new(RateLimiter::new(qps, burst)) }
    }
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> RateLimited<S> {
        RateLimited { inner, limiter: Arc::clone(&self.limiter), token: false, sleep: None }
    }
}

/// A service whose requests each take a token first: it is not ready
/// until it holds one (so a buffer in front of it queues requests in
/// order while the bucket is empty).
pub(crate) struct RateLimited<S> {
    inner: S,
    limiter: Arc<RateLimiter>,
    token: bool,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for RateLimited<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimited").field("inner", &self.inner).field("token", &self.token).finish()
    }
}

impl<S, R> tower::Service<R> for RateLimited<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        while !self.token {
            if let Some(sleep) = self.sleep.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            }
            match self.limiter.try_acquire() {
                Ok(()) => self.token = true,
                Err(wait) => self.sleep = Some(Box::pin(tokio::time::sleep(wait))),
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        // `poll_ready` took the token this request spends.
        self.token = false;
        self.inner.call(request)
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

    /// Under a paused clock: a service under the layer answers the burst
    /// at once, then one request per 1/qps.
    #[tokio::test(start_paused = true)]
    async fn the_layer_holds_each_request_until_it_has_a_token() {
        use tower::{Layer as _, Service as _, ServiceExt as _};
        let answered = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&answered);
        let inner = tower::service_fn(move |request: u32| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock().expect("lock").push((request, Instant::now()));
                Ok::<_, std::convert::Infallible>(request)
            }
        });
        let mut service = RateLimitLayer::new(4.0, 2).layer(inner);
        let start = Instant::now();
        for request in 0..6 {
            let answer = service.ready().await.expect("ready").call(request).await.expect("answer");
            assert_eq!(answer, request);
        }
        let times: Vec<f64> =
            answered.lock().expect("lock").iter().map(|(_, at)| (*at - start).as_secs_f64()).collect();
        let expected = [0.0, 0.0, 0.25, 0.5, 0.75, 1.0];
        for (time, want) in times.iter().zip(expected) {
            assert!((time - want).abs() < 0.01, "answered at {times:?}, expected {expected:?}");
        }
    }
}
