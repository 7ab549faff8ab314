//! Pod and node events written to the API as core/v1 Events with source
//! `kubelet` on the node, as the kubelet writes them, so `kubectl describe
//! pod` shows them:
//! - **aggregation**: an event repeating (same object, type, reason and
//!   message) within 10 minutes raises the `count` and `lastTimestamp` of
//!   one Event instead of making a new one, as upstream's event logger;
//!   kube-rs's `Recorder` is not used because it writes
//!   `events.k8s.io/v1` Events, which a node's identity may not write
//!   (the Node authorizer allows core/v1 events only);
//! - **spam filter**: as upstream's, each object may make 25 events at
//!   once, then one per 5 minutes; the rest are dropped and counted.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::time::Instant;

use kubelet_pods::events::{EventQueue, EventType};

/// Upstream's spam filter: events an object may make at once…
const SPAM_BURST: f64 = 25.0;
/// …and how often it gets one more.
const SPAM_REFILL: Duration = Duration::from_secs(300);

/// Upstream's spam filter: a token bucket per object.
#[derive(Debug, Default)]
pub(crate) struct SpamFilter {
    buckets: HashMap<String, (f64, Instant)>,
}

impl SpamFilter {
    /// Whether an event about `object` may go to the API now.
    pub(crate) fn allow(&mut self, object: &ObjectReference, now: Instant) -> bool {
        let key = format!(
            "{}/{}/{}/{}",
            object.kind.as_deref().unwrap_or_default(),
            object.namespace.as_deref().unwrap_or_default(),
            object.name.as_deref().unwrap_or_default(),
            object.uid.as_deref().unwrap_or_default()
        );
        // Buckets full again are forgotten.
        if self.buckets.len() > 4_096 {
            self.buckets.retain(|_, (tokens, at)| {
                *tokens + now.saturating_duration_since(*at).as_secs_f64() / SPAM_REFILL.as_secs_f64() < SPAM_BURST
            });
        }
        let (tokens, at) = self.buckets.entry(key).or_insert((SPAM_BURST, now));
        *tokens =
            (*tokens + now.saturating_duration_since(*at).as_secs_f64() / SPAM_REFILL.as_secs_f64()).min(SPAM_BURST);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// How long a repeated event updates its Event rather than making a new
/// one (upstream's event logger keeps its cache that long).
const AGGREGATION_WINDOW: Duration = Duration::from_secs(600);

/// What makes two events the same one: object UID and field path, type,
/// reason, message.
type Similar = (String, String, String, String, String);

/// The Event written for one: its name, its count, when it was last
/// written.
type Written = (String, i32, Instant);

/// Writes queued events to the API as node `node` until the queue closes.
pub(crate) async fn publish(client: kube::Client, node: &str, mut queue: EventQueue) {
    let mut spam = SpamFilter::default();
    let mut dropped: u64 = 0;
    let mut written: HashMap<Similar, Written> = HashMap::new();
    while let Some(event) = queue.0.recv().await {
        let now = Instant::now();
        if !spam.allow(&event.regarding, now) {
            dropped += 1;
            if dropped.is_power_of_two() {
                tracing::info!(dropped, "events dropped by the spam filter (25 per object, then one per 5 minutes)");
            }
            continue;
        }
        written.retain(|_, (_, _, at)| now.saturating_duration_since(*at) < AGGREGATION_WINDOW);
        let type_ = match event.type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        let message = truncate(&event.message, 1024);
        let key = (
            event.regarding.uid.clone().unwrap_or_default(),
            event.regarding.field_path.clone().unwrap_or_default(),
            type_.to_owned(),
            event.reason.clone(),
            message.clone(),
        );
        let namespace = event.regarding.namespace.clone().unwrap_or_else(|| "default".into());
        let api: kube::Api<k8s_openapi::api::core::v1::Event> = kube::Api::namespaced(client.clone(), &namespace);
        let stamp = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
        let result = match written.get(&key) {
            Some((name, count, _)) => {
                let patch = serde_json::json!({"count": count + 1, "lastTimestamp": stamp});
                let params = kube::api::PatchParams::default();
                api.patch(name, &params, &kube::api::Patch::Merge(&patch)).await.map(|_| (name.clone(), count + 1))
            }
            None => {
                let name = format!(
                    "{}.{:x}",
                    event.regarding.name.as_deref().unwrap_or(node),
                    k8s_openapi::jiff::Timestamp::now().as_nanosecond()
                );
                let object = k8s_openapi::api::core::v1::Event {
                    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(namespace.clone()),
                        ..Default::default()
                    },
                    involved_object: event.regarding.clone(),
                    reason: Some(event.reason.clone()),
                    message: Some(message),
                    type_: Some(type_.to_owned()),
                    source: Some(k8s_openapi::api::core::v1::EventSource {
                        component: Some("kubelet".into()),
                        host: Some(node.to_owned()),
                    }),
                    count: Some(1),
                    first_timestamp: Some(stamp.clone()),
                    last_timestamp: Some(stamp),
                    reporting_component: Some("kubelet".into()),
                    reporting_instance: Some(node.to_owned()),
                    ..Default::default()
                };
                api.create(&kube::api::PostParams::default(), &object).await.map(|_| (name, 1))
            }
        };
        match result {
            Ok((name, count)) => {
                written.insert(key, (name, count, now));
            }
            Err(error) => {
                // An Event gone from the API (expired) is made again next time.
                written.remove(&key);
                tracing::warn!(reason = %event.reason, %error, "cannot write an event");
            }
        }
    }
}

/// At most `max` bytes of `text`, cut on a character boundary.
fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spam_filter_allows_a_burst_then_one_per_five_minutes() {
        let mut filter = SpamFilter::default();
        let pod = ObjectReference { kind: Some("Pod".into()), name: Some("p".into()), ..ObjectReference::default() };
        let other = ObjectReference { kind: Some("Pod".into()), name: Some("q".into()), ..ObjectReference::default() };
        let now = Instant::now();
        assert_eq!((0..30).filter(|_| filter.allow(&pod, now)).count(), 25);
        assert!(filter.allow(&other, now), "each object has its own bucket");
        assert!(!filter.allow(&pod, now + Duration::from_secs(60)));
        assert!(filter.allow(&pod, now + Duration::from_secs(301)));
        assert!(!filter.allow(&pod, now + Duration::from_secs(302)));
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("héllo", 2), "h");
    }
}
