//! The ConfigMaps and Secrets that running pods' volumes show, each kept
//! current by a watch of its own (`fieldSelector=metadata.name=<name>`),
//! as upstream's default change-detection strategy (`Watch`) does: one
//! watch per object, shared by every pod that reads it, started at the
//! first read (a pod's start: its volumes, env and image pull secrets; or
//! the periodic volume rewrite) and stopped once no pod has read it for
//! [`UNREAD_KEPT`] (its pods are gone). Starts and rewrites then read
//! memory, not the API: a node's cost to the API server is a watch per
//! object instead of a GET per object per start and per period.
//!
//! A watch that has not listed its object yet (the first read, or an API
//! server that refuses the watch) is waited on for [`SYNC_DEADLINE`]; past
//! it the caller reads the object itself. A watch that fails after its
//! list keeps the last state it saw while it resumes (upstream's reflector
//! store does the same).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::mirror::{Noise, watch_events};
use crate::volume::ObjectKind;

/// An object's data: its keys and their bytes.
pub(crate) type Data = BTreeMap<String, Vec<u8>>;

/// How long a read waits for a new watch's first list before reading the
/// object itself.
pub(crate) const SYNC_DEADLINE: Duration = Duration::from_secs(2);

/// A watch no read asked for this long (its pods are gone: a running pod's
/// volumes are rewritten every period, 60 s by default) is stopped.
pub(crate) const UNREAD_KEPT: Duration = Duration::from_secs(600);

/// The object watches of one node. Dropping it (its last clone) stops them.
#[derive(Clone, Default)]
pub(crate) struct ObjectWatches {
    entries: Arc<Mutex<BTreeMap<Key, Entry>>>,
}

type Key = (ObjectKind, String, String);

#[derive(Clone)]
struct Entry {
    /// `None` until the watch listed the object; then `Some(None)` while
    /// there is no such object, `Some(Some(data))` while there is.
    state: watch::Receiver<Option<Option<Data>>>,
    started: Instant,
    last_read: Arc<Mutex<Instant>>,
    /// Stops the watch when the entry goes.
    _stop: Arc<DropGuard>,
}

impl ObjectWatches {
    /// The object's data as its watch last saw it (`Some(None)`: there is
    /// no such object), starting the watch at the first read; `None` when
    /// the watch has not listed it within [`SYNC_DEADLINE`] of its start
    /// (the first reads wait for that, later ones do not).
    pub(crate) async fn read(
        &self,
        client: &kube::Client,
        kind: ObjectKind,
        namespace: &str,
        name: &str,
    ) -> Option<Option<Data>> {
        let entry = self.entry(client, (kind, namespace.to_owned(), name.to_owned()));
        *entry.last_read.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        let mut state = entry.state.clone();
        // Only the first reads wait: a watch that has not listed its object
        // in SYNC_DEADLINE holds no later read back.
        let wait = SYNC_DEADLINE.saturating_sub(entry.started.elapsed());
        let listed = tokio::time::timeout(wait, state.wait_for(Option::is_some)).await;
        match listed {
            Ok(Ok(state)) => state.clone(),
            _ => None,
        }
    }

    fn entry(&self, client: &kube::Client, key: Key) -> Entry {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = entries.get(&key) {
            return entry.clone();
        }
        let (kind, namespace, name) = key.clone();
        tracing::debug!(kind = kind.noun(), %namespace, %name, "watching an object pods' volumes show");
        let (tx, state) = watch::channel(None);
        let stop = CancellationToken::new();
        let now = Instant::now();
        let entry = Entry {
            state,
            started: now,
            last_read: Arc::new(Mutex::new(now)),
            _stop: Arc::new(stop.clone().drop_guard()),
        };
        let follower = follow(client.clone(), kind, namespace, name, tx);
        let unread = until_unread(Arc::downgrade(&self.entries), key.clone(), Arc::clone(&entry.last_read));
        // Not supervised: one object's watch; it ends once no read asked
        // for it for UNREAD_KEPT, or when the node's watches are dropped.
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = follower => {}
                () = unread => {}
            }
        });
        entries.insert(key, entry.clone());
        entry
    }
}

/// Returns once no read asked for the object of `key` for [`UNREAD_KEPT`],
/// having taken its entry out of `entries`.
async fn until_unread(entries: std::sync::Weak<Mutex<BTreeMap<Key, Entry>>>, key: Key, last_read: Arc<Mutex<Instant>>) {
    loop {
        let read_at = *last_read.lock().unwrap_or_else(|p| p.into_inner());
        tokio::time::sleep_until(read_at + UNREAD_KEPT).await;
        if last_read.lock().unwrap_or_else(|p| p.into_inner()).elapsed() < UNREAD_KEPT {
            continue;
        }
        if let Some(entries) = entries.upgrade() {
            let mut entries = entries.lock().unwrap_or_else(|p| p.into_inner());
            // Ours, not one made for the key since.
            if entries.get(&key).is_some_and(|e| Arc::ptr_eq(&e.last_read, &last_read)) {
                entries.remove(&key);
            }
        }
        let (kind, namespace, name) = key;
        tracing::debug!(kind = kind.noun(), %namespace, %name, "stopped watching an object no pod reads");
        return;
    }
}

/// Follows one object into `state` until the watch ends.
async fn follow(
    client: kube::Client,
    kind: ObjectKind,
    namespace: String,
    name: String,
    state: watch::Sender<Option<Option<Data>>>,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    match kind {
        ObjectKind::ConfigMap => {
            let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
            follow_events(watch_events(api, config, "volume ConfigMap", Noise::Quiet), &name, configmap_data, state)
                .await;
        }
        ObjectKind::Secret => {
            let api: Api<Secret> = Api::namespaced(client, &namespace);
            follow_events(watch_events(api, config, "volume Secret", Noise::Quiet), &name, secret_data, state).await;
        }
    }
}

async fn follow_events<K: kube::Resource>(
    mut events: futures_util::stream::BoxStream<'static, watcher::Event<K>>,
    name: &str,
    data: fn(K) -> Data,
    state: watch::Sender<Option<Option<Data>>>,
) {
    // What a (re)list found so far: shown once it is complete.
    let mut listing: Option<Data> = None;
    while let Some(event) = events.next().await {
        // Only the object named (the field selector's; a server that
        // ignored it sends others).
        let other = match &event {
            watcher::Event::InitApply(o) | watcher::Event::Apply(o) | watcher::Event::Delete(o) => {
                o.meta().name.as_deref() != Some(name)
            }
            watcher::Event::Init | watcher::Event::InitDone => false,
        };
        if other {
            continue;
        }
        match event {
            watcher::Event::Init => listing = None,
            watcher::Event::InitApply(object) => listing = Some(data(object)),
            watcher::Event::InitDone => {
                state.send_replace(Some(listing.take()));
            }
            watcher::Event::Apply(object) => {
                state.send_replace(Some(Some(data(object))));
            }
            watcher::Event::Delete(_) => {
                state.send_replace(Some(None));
            }
        }
    }
}

/// A ConfigMap's data: `data` (as UTF-8 bytes) and `binaryData`.
pub(crate) fn configmap_data(map: ConfigMap) -> Data {
    let mut data: Data = map.data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.into_bytes())).collect();
    data.extend(map.binary_data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)));
    data
}

/// A Secret's data: `data` and `stringData` (as UTF-8 bytes).
pub(crate) fn secret_data(secret: Secret) -> Data {
    let mut data: Data = secret.data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)).collect();
    data.extend(secret.string_data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.into_bytes())));
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(value: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "m"}, "data": {"k": value}})).expect("configmap")
    }

    fn data(value: &str) -> Option<Option<Data>> {
        Some(Some(BTreeMap::from([("k".to_owned(), value.as_bytes().to_vec())])))
    }

    /// A watch no read asked for in UNREAD_KEPT is taken out and stopped;
    /// a read restarts the count.
    #[tokio::test(start_paused = true)]
    async fn an_unread_watch_is_forgotten_and_stopped() {
        let watches = ObjectWatches::default();
        let key = (ObjectKind::ConfigMap, "default".to_owned(), "m".to_owned());
        let stop = CancellationToken::new();
        let entry = Entry {
            state: watch::channel(None).1,
            started: Instant::now(),
            last_read: Arc::new(Mutex::new(Instant::now())),
            _stop: Arc::new(stop.clone().drop_guard()),
        };
        let last_read = Arc::clone(&entry.last_read);
        watches.entries.lock().expect("lock").insert(key.clone(), entry);
        let unread = tokio::spawn(until_unread(Arc::downgrade(&watches.entries), key.clone(), Arc::clone(&last_read)));
        tokio::time::sleep(UNREAD_KEPT / 2).await;
        let read_again = Instant::now();
        *last_read.lock().expect("lock") = read_again;
        drop(last_read);
        unread.await.expect("the expiry");
        assert!(read_again.elapsed() >= UNREAD_KEPT, "kept {:?} after the last read", read_again.elapsed());
        assert!(!watches.entries.lock().expect("lock").contains_key(&key), "forgotten");
        assert!(stop.is_cancelled(), "its watch stopped");
    }

    /// A list shows once it is complete, changes and deletions follow, and
    /// a relist that no longer finds the object (deleted while the watch
    /// was down) shows it gone.
    #[tokio::test]
    async fn the_state_follows_lists_changes_and_deletions() {
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(stream).boxed();
        let (state, mut seen) = watch::channel(None);
        let follower = tokio::spawn(async move { follow_events(stream, "m", configmap_data, state).await });
        type Step = (Vec<watcher::Event<ConfigMap>>, Option<Option<Data>>);
        let steps: Vec<Step> = vec![
            (vec![watcher::Event::Init, watcher::Event::InitApply(map("1")), watcher::Event::InitDone], data("1")),
            (vec![watcher::Event::Apply(map("2"))], data("2")),
            (vec![watcher::Event::Delete(map("2"))], Some(None)),
            (vec![watcher::Event::Apply(map("3"))], data("3")),
            (vec![watcher::Event::Init, watcher::Event::InitDone], Some(None)),
        ];
        for (sent, want) in steps {
            for event in sent {
                events.send(event).expect("send");
            }
            let reached = tokio::time::timeout(Duration::from_secs(30), seen.wait_for(|s| *s == want)).await.is_ok();
            assert!(reached, "wanted {want:?}, state {:?}", *seen.borrow());
        }
        drop(events);
        follower.await.expect("the follower ends with its stream");
    }
}
