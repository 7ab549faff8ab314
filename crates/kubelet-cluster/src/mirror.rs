//! The one loop that keeps a node-side table equal to a kind of
//! cluster-scoped API object, as the kubelet's informers do: a watch
//! (kube-runtime's watcher: resumed from its resourceVersion, a relist
//! after 410), each object set by name as it is listed or changed, a
//! deleted one removed, and those deleted while the watch was down dropped
//! when it lists again. A failing watch resumes after the one jittered
//! backoff ([`RetryBackoff::for_watches`]), reset by the next event.
//!
//! The node mirrors RuntimeClasses ([`ClassHandlers`]) and CSIDriver
//! objects ([`CsiDriverObjects`]).
//!
//! Every watch of cluster mode (this loop, the pod source, the Node's
//! deletion, a CSR's approval) reads its events through [`watch_events`]:
//! one place where a failing watch is logged and waited out.
//!
//! [`RetryBackoff::for_watches`]: crate::retry::RetryBackoff::for_watches

use futures_util::StreamExt as _;
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::serde::de::DeserializeOwned;
use kube::Resource as _;
use kube::api::Api;
use kube::runtime::watcher;

use crate::runtime_class::ClassHandlers;
use crate::volume::CsiDriverObjects;

/// A node-side table of one kind of cluster-scoped object, by name.
pub(crate) trait Mirror: Send + 'static {
    /// The API object mirrored.
    type Object: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static;
    /// Its kind, for logs.
    const KIND: &'static str;
    /// Sets (or replaces) `name` from `object`.
    fn set(&self, name: &str, object: Self::Object);
    /// Forgets `name`.
    fn remove(&self, name: &str);
    /// The names the table holds.
    fn names(&self) -> Vec<String>;
    /// The first full list was mirrored.
    fn listed(&self) {}
}

/// How loudly a failed watch is logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Noise {
    /// A warning: the node misses changes while it lasts.
    Warn,
    /// A debug line: the caller has another way to learn the news.
    Quiet,
}

/// How long each watch request of a watch asks to last (`timeoutSeconds`),
/// drawn once per watch between 5 and 10 minutes as upstream's reflector
/// draws it: a node's watches do not end together, and each costs one
/// request per 7.5 minutes on average (kube-runtime's default, 290 s,
/// cost one per 4.8 minutes).
fn watch_timeout() -> u32 {
    let drawn = crate::retry::jittered(std::time::Duration::from_secs(300), 1.0);
    u32::try_from(drawn.as_secs()).unwrap_or(600)
}

/// The one watch of cluster mode: kube-runtime's watcher (resumed from its
/// resourceVersion, relisted after a 410) with its errors logged, naming
/// `what`, and waited out with the one jittered backoff
/// ([`RetryBackoff::for_watches`]), reset by the next event: only events
/// come out, and a failing API is not asked in a tight loop.
///
/// [`RetryBackoff::for_watches`]: crate::retry::RetryBackoff::for_watches
pub(crate) fn watch_events<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    noise: Noise,
) -> futures_util::stream::BoxStream<'static, watcher::Event<K>>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let backoff = std::sync::Arc::new(std::sync::Mutex::new(crate::retry::RetryBackoff::for_watches()));
    let config = match config.timeout {
        Some(_) => config,
        None => config.timeout(watch_timeout()),
    };
    watcher(api, config)
        .filter_map(move |event| {
            let backoff = std::sync::Arc::clone(&backoff);
            async move {
                // The pace set before any await (the lock is not held across one).
                let delay = {
                    let mut pace = backoff.lock().unwrap_or_else(|p| p.into_inner());
                    if event.is_ok() {
                        pace.reset();
                        None
                    } else {
                        Some(pace.next_delay())
                    }
                };
                match (event, delay) {
                    (Ok(event), _) => Some(event),
                    (Err(error), delay) => {
                        let delay = delay.unwrap_or_default();
                        match noise {
                            Noise::Warn => {
                                tracing::warn!(watch = what, %error, retry_in = ?delay, "watch failed; resuming")
                            }
                            Noise::Quiet => {
                                tracing::debug!(watch = what, %error, retry_in = ?delay, "watch failed; resuming")
                            }
                        }
                        tokio::time::sleep(delay).await;
                        None
                    }
                }
            }
        })
        .boxed()
}

/// Keeps `mirror` equal to the cluster's objects of its kind until the
/// stream ends (run it under the node's shutdown).
pub(crate) async fn follow<M: Mirror>(client: kube::Client, mirror: M) {
    let api: Api<M::Object> = Api::all(client);
    let mut events = watch_events(api, watcher::Config::default(), M::KIND, Noise::Warn);
    let mut listed: Vec<String> = Vec::new();
    let name_of = |object: &M::Object| object.meta().name.clone().unwrap_or_default();
    while let Some(event) = events.next().await {
        match event {
            watcher::Event::Apply(object) => {
                let name = name_of(&object);
                tracing::info!(kind = M::KIND, %name, "cluster object seen");
                mirror.set(&name, object);
            }
            watcher::Event::InitApply(object) => {
                let name = name_of(&object);
                tracing::info!(kind = M::KIND, %name, "cluster object listed");
                listed.push(name.clone());
                mirror.set(&name, object);
            }
            watcher::Event::Delete(object) => {
                let name = name_of(&object);
                tracing::info!(kind = M::KIND, %name, "cluster object deleted");
                mirror.remove(&name);
            }
            watcher::Event::Init => listed.clear(),
            watcher::Event::InitDone => {
                // Objects deleted while the watch was down.
                for name in mirror.names() {
                    if !listed.contains(&name) {
                        mirror.remove(&name);
                    }
                }
                mirror.listed();
            }
        }
    }
}

impl Mirror for ClassHandlers {
    type Object = RuntimeClass;
    const KIND: &'static str = "RuntimeClass";

    fn set(&self, name: &str, class: RuntimeClass) {
        ClassHandlers::set(self, name, &class.handler);
    }

    fn remove(&self, name: &str) {
        ClassHandlers::remove(self, name);
    }

    fn names(&self) -> Vec<String> {
        ClassHandlers::names(self)
    }

    fn listed(&self) {
        ClassHandlers::listed(self);
    }
}

impl Mirror for CsiDriverObjects {
    type Object = CSIDriver;
    const KIND: &'static str = "CSIDriver";

    fn set(&self, name: &str, driver: CSIDriver) {
        CsiDriverObjects::set(self, name, driver.spec);
    }

    fn remove(&self, name: &str) {
        CsiDriverObjects::remove(self, name);
    }

    fn names(&self) -> Vec<String> {
        CsiDriverObjects::names(self)
    }
}

#[cfg(test)]
mod tests {
    /// Each watch asks for 5 to 10 minutes, drawn anew for each watch.
    #[test]
    fn watch_timeouts_are_drawn_between_five_and_ten_minutes() {
        let drawn: Vec<u32> = (0..50).map(|_| super::watch_timeout()).collect();
        assert!(drawn.iter().all(|t| (300..600).contains(t)), "{drawn:?}");
        assert!(drawn.iter().any(|t| *t != drawn[0]), "all the same: {drawn:?}");
    }
}
