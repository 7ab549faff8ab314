//! Reads of the API that many callers want at once (a namespace's
//! services for a burst of container starts, a ConfigMap shared by many
//! pods' volumes): one slot per key holds the last answer and when it was
//! read; a caller takes a fresh-enough answer, and a read under way is
//! waited for, not repeated.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Above this many slots, those nobody used for a while are forgotten.
const PRUNE_ABOVE: usize = 64;

type Slot<V> = Arc<tokio::sync::Mutex<Option<(Instant, V)>>>;

/// The last answer per key. Cheap to clone (shared).
pub(crate) struct ReadCache<K, V> {
    slots: Arc<Mutex<BTreeMap<K, Slot<V>>>>,
}

impl<K, V> Clone for ReadCache<K, V> {
    fn clone(&self) -> Self {
        ReadCache { slots: Arc::clone(&self.slots) }
    }
}

impl<K, V> Default for ReadCache<K, V> {
    fn default() -> Self {
        ReadCache { slots: Arc::default() }
    }
}

impl<K: Ord, V: Clone> ReadCache<K, V> {
    /// The answer for `key` read at most `max_age` ago, else `read()`'s
    /// (kept; an error is not). Slots unused for `forget_after` are
    /// dropped once there are many.
    pub(crate) async fn get_or_read<F, Fut, E>(
        &self,
        key: K,
        max_age: Duration,
        forget_after: Duration,
        read: F,
    ) -> Result<V, E>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<V, E>>,
    {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if slots.len() > PRUNE_ABOVE {
                // A slot in use stays; an idle one stays while it is recent.
                slots.retain(|_, slot| {
                    slot.try_lock().map_or(true, |s| s.as_ref().is_some_and(|(at, _)| at.elapsed() < forget_after))
                });
            }
            Arc::clone(slots.entry(key).or_default())
        };
        let mut slot = slot.lock().await;
        if let Some((_, value)) = slot.as_ref().filter(|(at, _)| at.elapsed() < max_age) {
            return Ok(value.clone());
        }
        let read_at = Instant::now();
        let value = read().await?;
        *slot = Some((read_at, value.clone()));
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn concurrent_callers_share_one_read_until_it_is_too_old() {
        let cache: ReadCache<&str, usize> = ReadCache::default();
        let reads = Arc::new(AtomicUsize::new(0));
        let read = || {
            let reads = Arc::clone(&reads);
            move || async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, String>(reads.fetch_add(1, Ordering::SeqCst) + 1)
            }
        };
        let age = Duration::from_secs(1);
        let callers: Vec<_> = (0..10)
            .map(|_| {
                let cache = cache.clone();
                let read = read();
                tokio::spawn(async move { cache.get_or_read("k", age, age * 10, read).await })
            })
            .collect();
        for caller in callers {
            assert_eq!(caller.await.expect("task"), Ok(1));
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1, "one read for all");
        assert_eq!(cache.get_or_read("k", age, age * 10, read()).await, Ok(1), "fresh enough");
        assert_eq!(cache.get_or_read("k", Duration::ZERO, age * 10, read()).await, Ok(2), "read again once too old");
        let failing = || async { Err::<usize, _>("down".to_owned()) };
        assert_eq!(cache.get_or_read("other", age, age * 10, failing).await, Err("down".to_owned()));
        assert_eq!(cache.get_or_read("other", age, age * 10, read()).await, Ok(3), "an error is not kept");
    }
}
