//! CPU limits for modules. Each container's CPU time is measured exactly:
//! the future that runs its wasm notes the thread's CPU clock around every
//! poll (a poll runs on one thread). At each epoch tick the store's
//! deadline callback settles a token bucket that fills at the limit's rate
//! (a limit of `500m` earns half a CPU-second per second, banking at most
//! one 100 ms period's worth); when the bucket is in debt, the module's
//! task sleeps until the debt is repaid, so over any stretch longer than a
//! period it uses no more than its limit. The cost is one clock read per
//! poll and per tick; modules without a limit are only measured.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustix::time::{ClockId, clock_gettime};

/// How much unused CPU a module may bank and spend in a burst.
const PERIOD: Duration = Duration::from_millis(100);

/// The calling thread's CPU time, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// One container's CPU time.
#[derive(Debug, Default)]
pub struct CpuMeter {
    /// CPU time of finished polls.
    done_ns: AtomicU64,
    /// The thread's CPU clock when the current poll began (0 between polls).
    poll_start_ns: AtomicU64,
}

impl CpuMeter {
    /// CPU time used so far, the current poll included when called from it.
    pub(crate) fn used(&self) -> Duration {
        let mut ns = self.done_ns.load(Ordering::Acquire);
        let start = self.poll_start_ns.load(Ordering::Acquire);
        if start != 0 {
            ns += thread_cpu_ns().saturating_sub(start);
        }
        Duration::from_nanos(ns)
    }
}

/// A future whose polls are charged to a meter.
pub(crate) struct Metered<'a, T> {
    inner: Pin<Box<dyn Future<Output = T> + Send + 'a>>,
    meter: Arc<CpuMeter>,
}

impl<'a, T> Metered<'a, T> {
    pub(crate) fn new(inner: impl Future<Output = T> + Send + 'a, meter: Arc<CpuMeter>) -> Self {
        Metered { inner: Box::pin(inner), meter }
    }
}

impl<T> Future for Metered<'_, T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let start = thread_cpu_ns().max(1);
        self.meter.poll_start_ns.store(start, Ordering::Release);
        let result = self.inner.as_mut().poll(cx);
        let spent = thread_cpu_ns().saturating_sub(start);
        self.meter.poll_start_ns.store(0, Ordering::Release);
        self.meter.done_ns.fetch_add(spent, Ordering::AcqRel);
        result
    }
}

/// The token bucket of one limited container.
#[derive(Debug)]
pub(crate) struct Throttle {
    meter: Arc<CpuMeter>,
    /// CPU-nanoseconds earned per nanosecond (the limit in cores).
    rate: f64,
    /// Earned and not spent, in CPU-nanoseconds; negative is debt.
    credit: f64,
    last: Instant,
    last_used: Duration,
}

impl Throttle {
    /// A bucket for a limit of `milli_cpus` (1000 is one CPU).
    pub(crate) fn new(meter: Arc<CpuMeter>, milli_cpus: u64) -> Throttle {
        let last_used = meter.used();
        Throttle { meter, rate: milli_cpus.max(1) as f64 / 1000.0, credit: 0.0, last: Instant::now(), last_used }
    }

    /// Settles the bucket; returns how long the module must pause.
    pub(crate) fn settle(&mut self) -> Option<Duration> {
        let now = Instant::now();
        let used = self.meter.used();
        let cap = PERIOD.as_nanos() as f64 * self.rate;
        self.credit = (self.credit + now.duration_since(self.last).as_nanos() as f64 * self.rate).min(cap);
        self.credit -= used.saturating_sub(self.last_used).as_nanos() as f64;
        self.last = now;
        self.last_used = used;
        (self.credit < 0.0).then(|| Duration::from_nanos((-self.credit / self.rate) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns CPU on this thread for about `d` of CPU time.
    fn burn(d: Duration) {
        let start = thread_cpu_ns();
        let mut x = 0u64;
        while thread_cpu_ns() - start < d.as_nanos() as u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
    }

    #[test]
    fn a_metered_future_is_charged_its_cpu_time() {
        let meter = Arc::new(CpuMeter::default());
        let future = Metered::new(async { burn(Duration::from_millis(30)) }, meter.clone());
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(future);
        let used = meter.used();
        assert!(used >= Duration::from_millis(30), "{used:?}");
        // Nothing is charged between polls.
        burn(Duration::from_millis(20));
        assert_eq!(meter.used(), used);
    }

    #[test]
    fn the_bucket_asks_for_a_pause_that_repays_the_debt() {
        let meter = Arc::new(CpuMeter::default());
        let mut throttle = Throttle::new(meter.clone(), 250);
        // 40 ms of CPU charged at once against a quarter of a CPU, with
        // nothing banked: the debt is repaid after 160 ms of wall time
        // (less the little earned since the bucket was made).
        meter.done_ns.store(40_000_000, Ordering::Release);
        let pause = throttle.settle().expect("in debt");
        assert!(pause <= Duration::from_millis(160) && pause >= Duration::from_millis(100), "{pause:?}");
        // Without further use, the bucket is never in debt.
        throttle.last -= pause + Duration::from_millis(1);
        assert_eq!(throttle.settle(), None);
    }
}
