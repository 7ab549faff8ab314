//! The cluster's RuntimeClass objects (`node.k8s.io/v1`), watched as the
//! kubelet's informer watches them: each class's `handler` goes into the
//! node's [`ClassHandlers`] table, a deleted class leaves it, and classes
//! deleted while the watch was down are dropped when it lists again.

use futures_util::StreamExt as _;
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::Api;
use kube::runtime::watcher;

use crate::runtime_class::ClassHandlers;

/// Keeps `classes` equal to the cluster's RuntimeClasses until the stream
/// ends (run it under the node's shutdown).
pub async fn follow(client: kube::Client, classes: ClassHandlers) {
    let api: Api<RuntimeClass> = Api::all(client);
    let mut events = watcher(api, watcher::Config::default()).boxed();
    let mut listed: Vec<String> = Vec::new();
    let mut backoff = crate::retry::RetryBackoff::for_watches();
    while let Some(event) = events.next().await {
        if event.is_ok() {
            backoff.reset();
        }
        match event {
            Ok(watcher::Event::Apply(class)) => {
                let name = class.metadata.name.clone().unwrap_or_default();
                tracing::info!(runtime_class = %name, handler = %class.handler, "RuntimeClass seen");
                classes.set(&name, &class.handler);
            }
            Ok(watcher::Event::InitApply(class)) => {
                let name = class.metadata.name.clone().unwrap_or_default();
                tracing::info!(runtime_class = %name, handler = %class.handler, "RuntimeClass listed");
                listed.push(name.clone());
                classes.set(&name, &class.handler);
            }
            Ok(watcher::Event::Delete(class)) => {
                let name = class.metadata.name.unwrap_or_default();
                tracing::info!(runtime_class = %name, "RuntimeClass deleted");
                classes.remove(&name);
            }
            Ok(watcher::Event::Init) => listed.clear(),
            Ok(watcher::Event::InitDone) => {
                for name in classes.names() {
                    if !listed.contains(&name) {
                        classes.remove(&name);
                    }
                }
                classes.listed();
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(%error, retry_in = ?delay, "RuntimeClass watch failed; resuming");
                tokio::time::sleep(delay).await;
            }
        }
    }
}
