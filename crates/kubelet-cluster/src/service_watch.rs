//! The cluster's Services, for containers' link variables
//! (`<NAME>_SERVICE_HOST`, ...), kept by one watch of all namespaces as
//! upstream's kubelet keeps a Service informer: a container start reads
//! memory, not the API. The watch starts at the first read (a node that
//! starts no container never opens it) and lasts as long as the node's
//! [`ServiceWatch`] (its last clone stops it).
//!
//! A watch that has not listed yet is waited on for [`SYNC_DEADLINE`] from
//! its start; past it the caller lists the namespace itself. After its
//! list, a watch that fails keeps the last state it saw while it resumes.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::mirror::{Noise, watch_events};
use crate::object_watch::SYNC_DEADLINE;

/// Services by (namespace, name).
type Services = BTreeMap<(String, String), Service>;

/// The node's Service watch, started at the first read.
#[derive(Clone, Default)]
pub(crate) struct ServiceWatch {
    started: Arc<OnceLock<Started>>,
}

struct Started {
    /// `None` until the watch listed the services.
    state: watch::Receiver<Option<Services>>,
    at: Instant,
    _stop: DropGuard,
}

impl ServiceWatch {
    /// The services of `namespace` as the watch last saw them, starting it
    /// at the first read; `None` while it has not listed within
    /// [`SYNC_DEADLINE`] of its start.
    pub(crate) async fn read(&self, client: &kube::Client, namespace: &str) -> Option<Vec<Service>> {
        let started = self.started.get_or_init(|| {
            let (tx, state) = watch::channel(None);
            let stop = CancellationToken::new();
            let api: Api<Service> = Api::all(client.clone());
            let events = watch_events(api, watcher::Config::default(), "Services", Noise::Warn);
            let follower = follow(events, tx);
            let cancelled = stop.clone();
            // Not supervised: a cache; reads past its deadline list the
            // namespace themselves. It ends with the node's ServiceWatch.
            tokio::spawn(async move {
                tokio::select! {
                    () = cancelled.cancelled() => {}
                    () = follower => {}
                }
            });
            tracing::debug!("watching the cluster's services for containers' link variables");
            Started { state, at: Instant::now(), _stop: stop.drop_guard() }
        });
        let mut state = started.state.clone();
        let wait = SYNC_DEADLINE.saturating_sub(started.at.elapsed());
        let listed = tokio::time::timeout(wait, state.wait_for(Option::is_some)).await.ok()?.ok()?;
        let services = listed.as_ref()?;
        let from = (namespace.to_owned(), String::new());
        Some(services.range(from..).take_while(|((ns, _), _)| ns == namespace).map(|(_, s)| s.clone()).collect())
    }
}

fn key(service: &Service) -> (String, String) {
    (service.metadata.namespace.clone().unwrap_or_default(), service.metadata.name.clone().unwrap_or_default())
}

/// Keeps `state` equal to what the watch says until it ends.
async fn follow(
    mut events: futures_util::stream::BoxStream<'static, watcher::Event<Service>>,
    state: watch::Sender<Option<Services>>,
) {
    // What a (re)list found so far: shown once it is complete.
    let mut listing = Services::new();
    while let Some(event) = events.next().await {
        match event {
            watcher::Event::Init => listing.clear(),
            watcher::Event::InitApply(service) => {
                listing.insert(key(&service), service);
            }
            watcher::Event::InitDone => {
                state.send_replace(Some(std::mem::take(&mut listing)));
            }
            watcher::Event::Apply(service) => state.send_modify(|services| {
                if let Some(services) = services {
                    services.insert(key(&service), service);
                }
            }),
            watcher::Event::Delete(service) => state.send_modify(|services| {
                if let Some(services) = services {
                    services.remove(&key(&service));
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(namespace: &str, name: &str, ip: &str) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": namespace, "name": name},
            "spec": {"clusterIP": ip}
        }))
        .expect("service")
    }

    fn names(state: &Option<Services>) -> Option<Vec<String>> {
        state.as_ref().map(|s| s.values().map(|s| format!("{}/{}", key(s).0, key(s).1)).collect())
    }

    /// Nothing shows before the list is complete; then changes and
    /// deletions follow, and a relist replaces what was seen.
    #[tokio::test]
    async fn the_state_follows_lists_changes_and_deletions() {
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(stream).boxed();
        let (state, mut seen) = watch::channel(None);
        let follower = tokio::spawn(follow(stream, state));
        let a = || service("a", "one", "10.0.0.1");
        let b = || service("b", "two", "10.0.0.2");
        events.send(watcher::Event::Init).expect("send");
        events.send(watcher::Event::InitApply(a())).expect("send");
        type Step = (Vec<watcher::Event<Service>>, Option<Vec<&'static str>>);
        let steps: Vec<Step> = vec![
            (vec![watcher::Event::InitDone], Some(vec!["a/one"])),
            (vec![watcher::Event::Apply(b())], Some(vec!["a/one", "b/two"])),
            (vec![watcher::Event::Delete(a())], Some(vec!["b/two"])),
            (vec![watcher::Event::Init, watcher::Event::InitApply(a()), watcher::Event::InitDone], Some(vec!["a/one"])),
        ];
        assert_eq!(names(&seen.borrow()), None, "shown before the list completed");
        for (sent, want) in steps {
            for event in sent {
                events.send(event).expect("send");
            }
            let want = want.map(|w| w.into_iter().map(str::to_owned).collect::<Vec<_>>());
            let reached = tokio::time::timeout(std::time::Duration::from_secs(30), seen.wait_for(|s| names(s) == want))
                .await
                .is_ok();
            assert!(reached, "wanted {want:?}, state {:?}", names(&seen.borrow()));
        }
        drop(events);
        follower.await.expect("the follower ends with its stream");
    }
}
