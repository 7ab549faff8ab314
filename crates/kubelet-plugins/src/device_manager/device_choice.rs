//! Which devices a container gets: pure choice logic, no I/O.
//!
//! Order of preference: devices the container must reuse (an earlier init
//! container's, for the same pod), then the plugin's preferred devices (when
//! it offers `GetPreferredAllocation`; unknown, unavailable and duplicate IDs
//! in its answer are ignored), then a NUMA-aligned fill: devices on NUMA nodes
//! already used first, then the smallest node that holds the rest, else the
//! biggest nodes, each in ID order. The result is deterministic for a given state.

use std::collections::BTreeSet;

/// A device that may be given out, with its NUMA nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Free<'a> {
    pub(crate) id: &'a str,
    pub(crate) numa: &'a [i64],
}

impl Free<'_> {
    /// The NUMA node the device is counted on (its first; -1 for none).
    pub(crate) fn primary_numa(&self) -> i64 {
        self.numa.first().copied().unwrap_or(-1)
    }
}

/// Chooses `n` devices; returns their positions in `free`, which is sorted
/// by ID. `must` and `preferred` only count where they name devices in
/// `free` (others are ignored).
pub(crate) fn choose(free: &[Free<'_>], must: &[String], preferred: &[String], n: usize) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(n);
    for id in must.iter().chain(preferred) {
        if chosen.len() == n {
            return chosen;
        }
        if let Ok(at) = free.binary_search_by(|f| f.id.cmp(id.as_str()))
            && !chosen.contains(&at)
        {
            chosen.push(at);
        }
    }
    if chosen.len() < n {
        fill_numa_aligned(free, &mut chosen, n);
    }
    chosen
}

fn fill_numa_aligned(free: &[Free<'_>], chosen: &mut Vec<usize>, n: usize) {
    let mut picked = vec![false; free.len()];
    for &at in chosen.iter() {
        picked[at] = true;
    }
    let used: BTreeSet<i64> = chosen.iter().map(|&at| free[at].primary_numa()).collect();
    // Free devices per NUMA node: a handful of nodes, so a short list.
    let mut order: Vec<(i64, usize)> = Vec::new();
    for (at, f) in free.iter().enumerate() {
        if !picked[at] {
            let node = f.primary_numa();
            match order.iter_mut().find(|(n, _)| *n == node) {
                Some((_, size)) => *size += 1,
                None => order.push((node, 1)),
            }
        }
    }
    let need = n - chosen.len();
    // Nodes already in use first; then the smallest node that fits the whole
    // remainder (best fit keeps big nodes whole for big requests); if none
    // fits, the biggest nodes first; ties by node number.
    order.sort_by_key(|&(node, size)| {
        let fits = size >= need;
        let size_rank = if fits { size as i64 } else { -(size as i64) };
        (!used.contains(&node), !fits, size_rank, node)
    });
    for (node, _) in order {
        for (at, f) in free.iter().enumerate() {
            if chosen.len() == n {
                return;
            }
            if !picked[at] && f.primary_numa() == node {
                picked[at] = true;
                chosen.push(at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(free: &[Free<'_>], chosen: Vec<usize>) -> Vec<String> {
        chosen.into_iter().map(|at| free[at].id.to_owned()).collect()
    }

    fn pick(spec: &[(&str, i64)], must: &[&str], preferred: &[&str], n: usize) -> Vec<String> {
        let numa: Vec<[i64; 1]> = spec.iter().map(|(_, node)| [*node]).collect();
        let mut free: Vec<Free<'_>> =
            spec.iter().zip(&numa).map(|((id, _), node)| Free { id, numa: node.as_slice() }).collect();
        free.sort_by(|a, b| a.id.cmp(b.id));
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let chosen = choose(&free, &owned(must), &owned(preferred), n);
        ids(&free, chosen)
    }

    #[test]
    fn fills_from_the_fewest_numa_nodes() {
        let devices = [("a", 0), ("b", 1), ("c", 1), ("d", 0), ("e", 1)];
        assert_eq!(pick(&devices, &[], &[], 2), ["a", "d"], "node 0 fits 2 most tightly");
        assert_eq!(pick(&devices, &[], &[], 3), ["b", "c", "e"], "only node 1 fits 3");
        assert_eq!(pick(&devices, &[], &[], 4), ["b", "c", "e", "a"], "biggest node first, then the next");
    }

    #[test]
    fn must_include_then_preferred_then_aligned_with_what_is_chosen() {
        let devices = [("a", 0), ("b", 1), ("c", 1), ("d", 0)];
        assert_eq!(pick(&devices, &["b"], &[], 2), ["b", "c"], "stays on the must-include device's node");
        assert_eq!(
            pick(&devices, &[], &["nope", "d", "d"], 2),
            ["d", "a"],
            "unknown and duplicate preferences ignored"
        );
    }

    #[test]
    fn devices_without_topology_are_one_group() {
        let devices = [Free { id: "x", numa: &[] }, Free { id: "y", numa: &[] }];
        let chosen = choose(&devices, &[], &[], 2);
        assert_eq!(ids(&devices, chosen), ["x", "y"]);
    }
}
