//! Pod sources and "sources ready": the node's pods come from sources (the
//! static manifest directory, the API's pods bound to the node), and what
//! an earlier run of the node left behind may be cleaned up only once every
//! source has delivered its first full list. Before that, a pod the node
//! does not know yet may simply not have been listed yet: cleaning up then
//! would stop its containers, free its devices and delete its volumes'
//! data (upstream's housekeeping waits for the same signal).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// A source of pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PodSource {
    /// Static pod manifests (`--pod-manifest-path`).
    File,
    /// The API server's pods bound to the node.
    Api,
}

/// Which sources the node has and which have delivered their first full
/// list. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SourcesReady {
    pending: Arc<Mutex<BTreeSet<PodSource>>>,
    ready: Arc<watch::Sender<bool>>,
}

impl Default for SourcesReady {
    fn default() -> Self {
        SourcesReady { pending: Arc::default(), ready: Arc::new(watch::channel(true).0) }
    }
}

impl SourcesReady {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<PodSource>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node has `source`: it is waited for until it is [`listed`](Self::listed).
    pub fn expect(&self, source: PodSource) {
        let mut pending = self.lock();
        pending.insert(source);
        self.ready.send_replace(false);
    }

    /// `source` delivered its first full list (later lists change nothing).
    pub fn listed(&self, source: PodSource) {
        let mut pending = self.lock();
        if pending.remove(&source) {
            tracing::info!(?source, waiting_for = ?*pending, "pod source delivered its first full list");
        }
        if pending.is_empty() {
            self.ready.send_replace(true);
        }
    }

    /// Whether every source has listed.
    pub fn all_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until every source has listed.
    pub(crate) async fn wait(&self) {
        let mut ready = self.ready.subscribe();
        let _ = ready.wait_for(|ready| *ready).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ready_once_every_expected_source_listed() {
        let sources = SourcesReady::default();
        assert!(sources.all_ready(), "no sources: nothing to wait for");
        sources.expect(PodSource::File);
        sources.expect(PodSource::Api);
        sources.listed(PodSource::File);
        assert!(!sources.all_ready());
        let waiter = tokio::spawn({
            let sources = sources.clone();
            async move { sources.wait().await }
        });
        sources.listed(PodSource::Api);
        tokio::time::timeout(std::time::Duration::from_secs(20), waiter).await.expect("in time").expect("task");
        assert!(sources.all_ready());
        // A later list of a source changes nothing.
        sources.listed(PodSource::Api);
        assert!(sources.all_ready());
    }
}
