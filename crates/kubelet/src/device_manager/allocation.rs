//! Which devices a container gets: pure choice logic, no I/O.
//!
//! Order of preference: devices the container must reuse (an earlier init
//! container's, for the same pod), then the plugin's preferred devices (when
//! it offers `GetPreferredAllocation`; unknown, unavailable and duplicate IDs
//! in its answer are ignored), then a NUMA-aligned fill: devices on NUMA nodes
//! already used first, then the smallest node that holds the rest, else the
//! biggest nodes, each in ID order. The result is deterministic for a given state.

use std::collections::{BTreeMap, BTreeSet};

/// A device that may be given out, with its NUMA nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Free {
    pub(crate) id: String,
    pub(crate) numa: Vec<i64>,
}

/// Chooses `n` device IDs. `free` is sorted by ID; `must` and `preferred`
/// must only name devices in `free` to be used (others are ignored).
pub(crate) fn choose(free: &[Free], must: &[String], preferred: &[String], n: usize) -> Vec<String> {
    let known: BTreeSet<&str> = free.iter().map(|f| f.id.as_str()).collect();
    let mut chosen: Vec<String> = Vec::with_capacity(n);
    for id in must.iter().chain(preferred) {
        if chosen.len() == n {
            return chosen;
        }
        if known.contains(id.as_str()) && !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() < n {
        fill_numa_aligned(free, &mut chosen, n);
    }
    chosen
}

fn primary_numa(f: &Free) -> i64 {
    f.numa.first().copied().unwrap_or(-1)
}

fn fill_numa_aligned(free: &[Free], chosen: &mut Vec<String>, n: usize) {
    let used: BTreeSet<i64> = free.iter().filter(|f| chosen.contains(&f.id)).map(primary_numa).collect();
    let mut groups: BTreeMap<i64, Vec<&Free>> = BTreeMap::new();
    for f in free.iter().filter(|f| !chosen.contains(&f.id)) {
        groups.entry(primary_numa(f)).or_default().push(f);
    }
    let need = n - chosen.len();
    let mut order: Vec<(i64, Vec<&Free>)> = groups.into_iter().collect();
    // Nodes already in use first; then the smallest node that fits the whole
    // remainder (best fit keeps big nodes whole for big requests); if none
    // fits, the biggest nodes first; ties by node number.
    order.sort_by_key(|(node, devices)| {
        let fits = devices.len() >= need;
        let size_rank = if fits { devices.len() as i64 } else { -(devices.len() as i64) };
        (!used.contains(node), !fits, size_rank, *node)
    });
    for (_, devices) in order {
        for f in devices {
            if chosen.len() == n {
                return;
            }
            chosen.push(f.id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free(spec: &[(&str, i64)]) -> Vec<Free> {
        let mut v: Vec<Free> = spec.iter().map(|(id, n)| Free { id: (*id).into(), numa: vec![*n] }).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    #[test]
    fn fills_from_the_fewest_numa_nodes() {
        let devices = free(&[("a", 0), ("b", 1), ("c", 1), ("d", 0), ("e", 1)]);
        assert_eq!(choose(&devices, &[], &[], 2), ["a", "d"], "node 0 fits 2 most tightly");
        assert_eq!(choose(&devices, &[], &[], 3), ["b", "c", "e"], "only node 1 fits 3");
        assert_eq!(choose(&devices, &[], &[], 4), ["b", "c", "e", "a"], "biggest node first, then the next");
    }

    #[test]
    fn must_include_then_preferred_then_aligned_with_what_is_chosen() {
        let devices = free(&[("a", 0), ("b", 1), ("c", 1), ("d", 0)]);
        assert_eq!(choose(&devices, &["b".into()], &[], 2), ["b", "c"], "stays on the must-include device's node");
        let preferred = vec!["nope".into(), "d".into(), "d".into()];
        assert_eq!(choose(&devices, &[], &preferred, 2), ["d", "a"], "unknown and duplicate preferences ignored");
    }

    #[test]
    fn devices_without_topology_are_one_group() {
        let devices = vec![Free { id: "x".into(), numa: vec![] }, Free { id: "y".into(), numa: vec![] }];
        assert_eq!(choose(&devices, &[], &[], 2), ["x", "y"]);
    }
}
