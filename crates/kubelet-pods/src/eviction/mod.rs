//! Eviction thresholds as the kubelet takes them: a signal, an operator
//! (`<`), and a quantity or a percentage of the signal's capacity.
//!
//! `--eviction-hard` and `--eviction-soft` read
//! `memory.available<100Mi,nodefs.available<10%`; a configuration file
//! gives the same as a map (`memory.available: 100Mi`). Without
//! `--eviction-hard` the node uses upstream's Linux defaults
//! ([`default_hard`]); giving any hard threshold replaces all four, as
//! upstream does. `0%` and `100%` turn a signal off.

pub mod local_storage;
pub mod manager;

/// The node's pressure (its own module: admission reads it too).
pub use crate::pressure;

use std::collections::BTreeMap;
use std::time::Duration;

use kubelet_provider::quantity::parse_units;

/// What a threshold watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    /// Memory capacity less the working set (node-wide).
    MemoryAvailable,
    /// Memory pods may use less their working set (the `kubepods` group).
    AllocatableMemoryAvailable,
    /// Bytes free on the file system of the root dir.
    NodefsAvailable,
    /// Inodes free there.
    NodefsInodesFree,
    /// Bytes free on the runtime's image file system.
    ImagefsAvailable,
    /// Inodes free there.
    ImagefsInodesFree,
    /// Process IDs left.
    PidAvailable,
}

impl Signal {
    /// Every signal, in upstream's spelling order.
    pub(crate) const ALL: [Signal; 7] = [
        Signal::MemoryAvailable,
        Signal::AllocatableMemoryAvailable,
        Signal::NodefsAvailable,
        Signal::NodefsInodesFree,
        Signal::ImagefsAvailable,
        Signal::ImagefsInodesFree,
        Signal::PidAvailable,
    ];

    /// The signal's name (`memory.available`).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Signal::MemoryAvailable => "memory.available",
            Signal::AllocatableMemoryAvailable => "allocatableMemory.available",
            Signal::NodefsAvailable => "nodefs.available",
            Signal::NodefsInodesFree => "nodefs.inodesFree",
            Signal::ImagefsAvailable => "imagefs.available",
            Signal::ImagefsInodesFree => "imagefs.inodesFree",
            Signal::PidAvailable => "pid.available",
        }
    }

    /// The signal named `name`.
    pub(crate) fn parse(name: &str) -> Option<Signal> {
        Signal::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The node condition the signal drives.
    pub(crate) fn condition(self) -> &'static str {
        match self {
            Signal::MemoryAvailable | Signal::AllocatableMemoryAvailable => "MemoryPressure",
            Signal::PidAvailable => "PIDPressure",
            _ => "DiskPressure",
        }
    }

    /// The resource the signal measures, as eviction messages name it.
    pub(crate) fn resource(self) -> &'static str {
        match self {
            Signal::MemoryAvailable | Signal::AllocatableMemoryAvailable => "memory",
            Signal::NodefsAvailable | Signal::ImagefsAvailable => "ephemeral-storage",
            Signal::NodefsInodesFree | Signal::ImagefsInodesFree => "inodes",
            Signal::PidAvailable => "pids",
        }
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A threshold's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ThresholdValue {
    /// An amount (bytes, inodes or process IDs).
    Quantity(u128),
    /// A share of the signal's capacity, in (0, 1).
    Percentage(f64),
}

impl ThresholdValue {
    /// The amount for a signal of `capacity`.
    pub fn amount(&self, capacity: u128) -> u128 {
        match *self {
            ThresholdValue::Quantity(q) => q,
            ThresholdValue::Percentage(p) => (capacity as f64 * p) as u128,
        }
    }
}

impl std::fmt::Display for ThresholdValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ThresholdValue::Quantity(q) => write!(f, "{q}"),
            ThresholdValue::Percentage(p) => write!(f, "{}%", p * 100.0),
        }
    }
}

/// One threshold.
#[derive(Clone, Debug, PartialEq)]
pub struct Threshold {
    /// What it watches.
    pub signal: Signal,
    /// Below what the signal meets it.
    pub value: ThresholdValue,
    /// How long it must be met before pods are evicted (soft thresholds;
    /// zero for hard ones).
    pub grace_period: Duration,
    /// Reclaimed beyond the threshold once it is met
    /// (`--eviction-minimum-reclaim`).
    pub min_reclaim: Option<ThresholdValue>,
}

/// Why a threshold setting was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ThresholdError {
    /// `{0}` is not `signal<value`.
    #[error("{0:?} is not an eviction threshold (signal<quantity or signal<percentage%)")]
    Syntax(String),
    /// No such signal.
    #[error("unknown eviction signal {0:?}")]
    Signal(String),
    /// A value that does not parse or is not above zero.
    #[error("eviction threshold {signal}: {value:?} is not a positive quantity or a percentage")]
    Value {
        /// The signal.
        signal: String,
        /// What was given.
        value: String,
    },
    /// A soft threshold without its grace period.
    #[error("grace period must be specified for the soft eviction threshold {0}")]
    NoGracePeriod(String),
}

/// Parses a value: `100Mi`, `10%`. `Ok(None)`: `0%` or `100%`, the
/// signal turned off.
pub(crate) fn parse_value(signal: &str, text: &str) -> Result<Option<ThresholdValue>, ThresholdError> {
    let bad = || ThresholdError::Value { signal: signal.to_owned(), value: text.to_owned() };
    let text = text.trim();
    if let Some(percent) = text.strip_suffix('%') {
        let percent: f64 = percent.trim().parse().map_err(|_| bad())?;
        if !(0.0..=100.0).contains(&percent) {
            return Err(bad());
        }
        if percent == 0.0 || percent == 100.0 {
            return Ok(None);
        }
        return Ok(Some(ThresholdValue::Percentage(percent / 100.0)));
    }
    let quantity = parse_units(text).map_err(|_| bad())?;
    if quantity == 0 {
        return Err(bad());
    }
    Ok(Some(ThresholdValue::Quantity(quantity)))
}

/// Parses `signal: value` pairs (a configuration file's map, or the
/// flag's split by [`parse_flag`]).
pub fn parse_map(map: &BTreeMap<String, String>) -> Result<Vec<Threshold>, ThresholdError> {
    let mut thresholds = Vec::new();
    for (name, value) in map {
        let signal = Signal::parse(name.trim()).ok_or_else(|| ThresholdError::Signal(name.clone()))?;
        if let Some(value) = parse_value(name, value)? {
            thresholds.push(Threshold { signal, value, grace_period: Duration::ZERO, min_reclaim: None });
        }
    }
    Ok(thresholds)
}

/// Splits `memory.available<100Mi,nodefs.available<10%` into a map.
pub fn parse_flag(text: &str) -> Result<BTreeMap<String, String>, ThresholdError> {
    let mut map = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (signal, value) = part.split_once('<').ok_or_else(|| ThresholdError::Syntax(part.to_owned()))?;
        map.insert(signal.trim().to_owned(), value.trim().to_owned());
    }
    Ok(map)
}

/// Upstream's Linux `--eviction-hard` default.
pub(crate) fn default_hard() -> BTreeMap<String, String> {
    [
        ("memory.available", "100Mi"),
        ("nodefs.available", "10%"),
        ("nodefs.inodesFree", "5%"),
        ("imagefs.available", "15%"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The node's thresholds.
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// Met: pods are evicted at once.
    pub hard: Vec<Threshold>,
    /// Met for their grace period: pods are evicted.
    pub soft: Vec<Threshold>,
}

impl Default for Thresholds {
    /// Upstream's defaults: the four hard thresholds, no soft ones.
    fn default() -> Self {
        Thresholds { hard: parse_map(&default_hard()).unwrap_or_default(), soft: Vec::new() }
    }
}

impl Thresholds {
    /// Thresholds from their settings: `hard` (`None`: the defaults),
    /// `soft` with a grace period each, minimum reclaims by signal.
    pub fn new(
        hard: Option<&BTreeMap<String, String>>,
        soft: &BTreeMap<String, String>,
        soft_grace: &BTreeMap<String, Duration>,
        min_reclaim: &BTreeMap<String, String>,
    ) -> Result<Thresholds, ThresholdError> {
        let mut hard = parse_map(hard.unwrap_or(&default_hard()))?;
        let mut soft = parse_map(soft)?;
        for threshold in &mut soft {
            threshold.grace_period = *soft_grace
                .get(threshold.signal.as_str())
                .ok_or_else(|| ThresholdError::NoGracePeriod(threshold.signal.to_string()))?;
        }
        for (name, value) in min_reclaim {
            let signal = Signal::parse(name.trim()).ok_or_else(|| ThresholdError::Signal(name.clone()))?;
            let value = parse_value(name, value)?;
            for threshold in hard.iter_mut().chain(soft.iter_mut()).filter(|t| t.signal == signal) {
                threshold.min_reclaim = value;
            }
        }
        Ok(Thresholds { hard, soft })
    }

    /// The hard threshold of `signal`, if any.
    pub fn hard(&self, signal: Signal) -> Option<&Threshold> {
        self.hard.iter().find(|t| t.signal == signal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_parse_as_the_kubelets_flags() {
        let map = parse_flag("memory.available<1Gi, nodefs.available<10%").expect("flag");
        let parsed = parse_map(&map).expect("thresholds");
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].signal, Signal::MemoryAvailable);
        assert_eq!(parsed[0].value, ThresholdValue::Quantity(1 << 30));
        assert_eq!(parsed[1].value.amount(1000), 100);
        assert_eq!(parse_flag("memory.available=1Gi"), Err(ThresholdError::Syntax("memory.available=1Gi".into())));
        let unknown = parse_map(&parse_flag("disk.free<1Gi").expect("flag"));
        assert_eq!(unknown, Err(ThresholdError::Signal("disk.free".into())));
        assert!(matches!(parse_value("memory.available", "0"), Err(ThresholdError::Value { .. })));
        assert!(matches!(parse_value("memory.available", "150%"), Err(ThresholdError::Value { .. })));
        assert_eq!(parse_value("memory.available", "0%"), Ok(None), "0% turns the signal off");
    }

    #[test]
    fn defaults_are_replaced_whole_and_soft_ones_need_a_grace_period() {
        let defaults = Thresholds::default();
        assert_eq!(defaults.hard.len(), 4);
        assert_eq!(defaults.hard(Signal::MemoryAvailable).map(|t| t.value), Some(ThresholdValue::Quantity(100 << 20)));
        let one = BTreeMap::from([("memory.available".to_owned(), "200Mi".to_owned())]);
        let given = Thresholds::new(Some(&one), &BTreeMap::new(), &BTreeMap::new(), &BTreeMap::new()).expect("ok");
        assert_eq!(given.hard.len(), 1, "no merging with the defaults");
        let soft = BTreeMap::from([("memory.available".to_owned(), "300Mi".to_owned())]);
        let refused = Thresholds::new(None, &soft, &BTreeMap::new(), &BTreeMap::new());
        assert_eq!(refused, Err(ThresholdError::NoGracePeriod("memory.available".into())));
        let grace = BTreeMap::from([("memory.available".to_owned(), Duration::from_secs(90))]);
        let reclaim = BTreeMap::from([("memory.available".to_owned(), "50Mi".to_owned())]);
        let both = Thresholds::new(None, &soft, &grace, &reclaim).expect("ok");
        assert_eq!(both.soft[0].grace_period, Duration::from_secs(90));
        assert_eq!(both.soft[0].min_reclaim, Some(ThresholdValue::Quantity(50 << 20)));
        assert_eq!(
            both.hard(Signal::MemoryAvailable).and_then(|t| t.min_reclaim),
            Some(ThresholdValue::Quantity(50 << 20))
        );
    }
}
