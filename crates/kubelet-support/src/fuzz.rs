//! A small mutation fuzzer that runs on stable Rust inside `cargo test`
//! (`cargo fuzz` needs a nightly toolchain).
//!
//! Each target is a test that hands [`Fuzz::run`] a function of one input.
//! The input is each seed of the target's checked-in corpus
//! (`fuzz/corpus/<target>/` at the workspace's root) as it is, then seeds changed by
//! one to four mutations (bit flips, boundary bytes, inserted, deleted,
//! repeated or spliced runs, tokens the formats use), from a fixed seed so
//! that a run is repeatable. A run stops after `RUSTLET_FUZZ_ITERATIONS`
//! inputs (default 2,000) or `RUSTLET_FUZZ_SECONDS` (default 3), whichever
//! comes first; `RUSTLET_FUZZ_SEED` changes the sequence. An input that
//! panics fails the test and is written under
//! `target/fuzz-crashes/<target>/` with its bytes printed, to be added to
//! the corpus and kept as a regression test.
//!
//! A target must not panic and must not hang on any input; what each
//! target feeds and checks is said at its test.

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One fuzz target's run.
pub struct Fuzz {
    target: &'static str,
    corpus: Vec<Vec<u8>>,
    state: u64,
    iterations: usize,
    budget: Duration,
}

/// Byte strings the formats here give meaning to.
const TOKENS: &[&[u8]] = &[
    b"\n",
    b"\r\n",
    b":",
    b": ",
    b"- ",
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b"'",
    b"/",
    b"..",
    b"../",
    b"%",
    b"%2F",
    b"%00",
    b"&",
    b"=",
    b"?",
    b"---\n",
    b"null",
    b"true",
    b"-1",
    b"0",
    b"4294967295",
    b"18446744073709551616",
    b"1e400",
    b"stdout",
    b"stderr",
    b" F ",
    b" P ",
    b"2026-01-01T00:00:00Z",
    b"apiVersion: v1\n",
    b"kind: Pod\n",
    b"\xff\xff",
    b"\x00\x00\x00\x00",
    b"\x7f\xff\xff\xff",
    b"\x80\x00\x00\x00",
];

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

impl Fuzz {
    /// The target `target`, with its corpus read from the workspace's
    /// `fuzz/corpus/<target>/` (a target without one starts from an empty
    /// input).
    pub fn new(target: &'static str) -> Fuzz {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
        let mut corpus: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
            .map(|entries| {
                entries.flatten().filter_map(|e| std::fs::read(e.path()).ok().map(|bytes| (e.path(), bytes))).collect()
            })
            .unwrap_or_default();
        corpus.sort();
        let corpus: Vec<Vec<u8>> = corpus.into_iter().map(|(_, bytes)| bytes).collect();
        let seed = env_number("RUSTLET_FUZZ_SEED").unwrap_or(0x005e_ed0f_2026);
        let name_hash =
            target.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Fuzz {
            target,
            corpus,
            state: seed ^ name_hash,
            iterations: env_number("RUSTLET_FUZZ_ITERATIONS").map_or(2000, |n| n as usize),
            budget: Duration::from_secs(env_number("RUSTLET_FUZZ_SECONDS").unwrap_or(3)),
        }
    }

    /// Adds a seed made by the test (an encoded message, say) to those of
    /// the corpus directory.
    pub fn seed(mut self, bytes: impl Into<Vec<u8>>) -> Fuzz {
        self.corpus.push(bytes.into());
        self
    }

    /// Feeds every seed, then mutated seeds, to `target`; returns how many
    /// inputs ran. Panics (naming the input) if one made `target` panic.
    pub fn run(mut self, mut target: impl FnMut(&[u8])) -> usize {
        if self.corpus.is_empty() {
            self.corpus.push(Vec::new());
        }
        let started = Instant::now();
        let mut ran = 0;
        for seed in self.corpus.clone() {
            self.one(&seed, &mut target);
            ran += 1;
        }
        while ran < self.iterations + self.corpus.len() && started.elapsed() < self.budget {
            let input = self.mutated();
            self.one(&input, &mut target);
            ran += 1;
        }
        ran
    }

    fn one(&self, input: &[u8], target: &mut impl FnMut(&[u8])) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(input)));
        if outcome.is_err() {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fuzz-crashes").join(self.target);
            let hash =
                input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
            let file = dir.join(format!("{hash:016x}"));
            let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&file, input));
            panic!(
                "fuzz target {} panicked on an input (saved as {}): {:?}",
                self.target,
                file.display(),
                String::from_utf8_lossy(input)
            );
        }
    }

    /// The next pseudo-random number (splitmix64).
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }

    fn mutated(&mut self) -> Vec<u8> {
        let pick = self.below(self.corpus.len());
        let mut input = self.corpus[pick].clone();
        for _ in 0..=self.below(4) {
            self.mutate(&mut input);
        }
        input
    }

    fn mutate(&mut self, input: &mut Vec<u8>) {
        let len = input.len();
        match self.below(9) {
            0 if len > 0 => {
                let at = self.below(len);
                input[at] ^= 1 << self.below(8);
            }
            1 if len > 0 => {
                let at = self.below(len);
                input[at] = [0u8, 0xff, 0x7f, 0x80, b'0', b'9', b' '][self.below(7)];
            }
            2 => {
                let at = self.below(len + 1);
                let byte = self.next() as u8;
                input.insert(at, byte);
            }
            3 if len > 0 => {
                let start = self.below(len);
                let end = (start + 1 + self.below(16)).min(len);
                input.drain(start..end);
            }
            4 if len > 0 => {
                let start = self.below(len);
                let end = (start + 1 + self.below(64)).min(len);
                let run = input[start..end].to_vec();
                let at = self.below(len + 1);
                for _ in 0..=self.below(8) {
                    input.splice(at..at, run.iter().copied());
                }
            }
            5 => {
                let token = TOKENS[self.below(TOKENS.len())];
                let at = self.below(len + 1);
                input.splice(at..at, token.iter().copied());
            }
            6 => {
                let which = self.below(self.corpus.len());
                let other = self.corpus[which].clone();
                let cut = self.below(len + 1);
                let from = self.below(other.len() + 1);
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            7 if len > 0 => input.truncate(self.below(len)),
            _ => {
                // A length field's worth of big or small numbers.
                let at = self.below(len + 1);
                let value = [0u32, 1, 0x7f, 0xff, 0xffff, 0x00ff_ffff, u32::MAX][self.below(7)];
                input.splice(at..at, value.to_be_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_input_fails_the_run_and_is_named() {
        let caught = std::panic::catch_unwind(|| {
            Fuzz::new("fuzz-self-test").run(|input| assert!(!input.contains(&b'{'), "a brace"));
        });
        let message = caught.expect_err("the target panics on some input");
        let text = message.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(text.contains("fuzz target fuzz-self-test panicked"), "{text}");
    }

    #[test]
    fn runs_are_repeatable() {
        let mut first = Vec::new();
        Fuzz::new("fuzz-self-test").run(|i| first.push(i.to_vec()));
        let mut second = Vec::new();
        Fuzz::new("fuzz-self-test").run(|i| second.push(i.to_vec()));
        let n = first.len().min(second.len());
        assert!(n > 10);
        assert_eq!(first[..n], second[..n]);
    }

    /// Fuzz target: CRI log files as the node reads them (whole, and as
    /// they grow in chunks of any size): lines out, never a panic; the
    /// text fed in chunks decodes as the whole does.
    #[test]
    fn fuzz_cri_log_lines() {
        let ran = Fuzz::new("cri-log").run(|input| {
            let whole = kubelet_provider::decode_cri_log(&String::from_utf8_lossy(input));
            let cut = input.len() / 3;
            let mut decoder = kubelet_provider::CriLogDecoder::default();
            let mut chunked = decoder.feed(&input[..cut]);
            chunked.extend(decoder.feed(&input[cut..]));
            chunked.extend(decoder.finish());
            if std::str::from_utf8(input).is_ok() {
                assert_eq!(chunked.concat(), whole.concat(), "chunked and whole decode alike");
            }
            let mut entries = kubelet_provider::CriLogDecoder::default();
            let _ = entries.feed_entries(input);
            let _ = entries.finish_entries();
        });
        assert!(ran > 1);
    }
}
