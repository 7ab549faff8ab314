//! Rules the library's source keeps, checked by scanning it (`cargo test
//! -p xtask`):
//! - no public function of a library crate or provider returns a `String`
//!   error; errors there are typed (`thiserror` enums), so that a caller
//!   can tell one failure from another without reading its text;
//! - every task spawned is supervised (its handle given to
//!   `Supervision::watch` within the next lines, or started by the
//!   supervisor), or says why not in a comment just above it that begins
//!   `// Not supervised` (one connection, one pod's task, a handle
//!   returned to a caller who watches it, ...) or `// Supervised` (watched
//!   further down). A long-running task spawned bare, with no word on it,
//!   fails the scan.

use std::path::{Path, PathBuf};

/// The library code the rules hold for: every crate's and provider's
/// `src/`, less the binary's (its errors end in the command's message).
fn library_sources(workspace: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for group in ["crates", "providers"] {
        let Ok(entries) = std::fs::read_dir(workspace.join(group)) else { continue };
        for entry in entries.flatten() {
            if entry.file_name() == "rustlet" {
                continue;
            }
            collect_rs(&entry.path().join("src"), &mut files);
        }
    }
    files.sort();
    files
}

fn collect_rs(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_rs(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The text before a file's unit tests (`#[cfg(test)] mod ...`).
fn without_tests(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod ").map_or(text, |at| &text[..at])
}

/// What starts a task: tokio's spawns, a thread, a `JoinSet`'s or
/// `TaskTracker`'s or runtime's `spawn` of a future.
const SPAWNS: &[&str] = &[
    "tokio::spawn(",
    "tokio::task::spawn(",
    "std::thread::spawn(",
    ".spawn(async",
    ".spawn({",
    "tasks.spawn(",
    "threads.spawn(",
    "waiters.spawn(",
    "stops.spawn(",
];

/// The name a `let` binds on this line (`let task = ...` → `task`).
fn bound_name(code: &str) -> Option<&str> {
    let rest = code.strip_prefix("let ")?;
    let rest = rest.strip_prefix("mut ").unwrap_or(rest);
    let name = rest.split(|c: char| !c.is_alphanumeric() && c != '_').next()?;
    (!name.is_empty()).then_some(name)
}

/// `(line, text)` of every spawn in `text` that is neither watched by the
/// supervisor in the next lines nor explained by a comment above it.
fn unsupervised_spawns(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = without_tests(text).lines().collect();
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let code = line.trim();
        if code.starts_with("//") || !SPAWNS.iter().any(|spawn| code.contains(spawn)) {
            continue;
        }
        let watched = code.contains(".watch(\"")
            || bound_name(code).is_some_and(|name| {
                lines[at + 1..lines.len().min(at + 12)].iter().any(|l| {
                    l.contains(".watch(\"") && l.split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == name)
                })
            });
        let explained = lines[at.saturating_sub(3)..at]
            .iter()
            .any(|l| l.trim().starts_with("// Not supervised") || l.trim().starts_with("// Supervised"));
        if !watched && !explained {
            found.push((at + 1, code.to_owned()));
        }
    }
    found
}

/// Whether the signature `sig` (from `fn` to its body or `;`) returns a
/// `Result` whose error is `String`.
fn returns_string_error(sig: &str) -> bool {
    let Some((_, ret)) = sig.split_once("->") else { return false };
    let ret: String = ret.split_whitespace().collect::<Vec<_>>().join(" ");
    let ret = ret.split(" where ").next().unwrap_or_default().trim();
    ret.starts_with("Result<") && ret.ends_with(", String>")
}

/// The signature starting at byte `at`: up to its body's `{` or a `;`.
fn signature(text: &str, at: usize) -> &str {
    let end = text[at..].find(['{', ';']).map_or(text.len(), |i| at + i);
    &text[at..end]
}

/// `(line, name)` of every public function (`pub fn`, `pub async fn`, and
/// the methods of a `pub trait`) in `text` that returns a `String` error.
fn string_errors(text: &str) -> Vec<(usize, String)> {
    let text = without_tests(text);
    let mut found = Vec::new();
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let mut trait_bodies = Vec::new();
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let at = offset + (line.len() - trimmed.len());
        offset += line.len();
        let rest = trimmed.strip_prefix("pub ").map(|r| r.strip_prefix("async ").unwrap_or(r));
        if let Some(rest) = rest.and_then(|r| r.strip_prefix("fn "))
            && returns_string_error(signature(text, at))
        {
            found.push((line_of(at), name_of(rest)));
        }
        if trimmed.starts_with("pub trait ")
            && let Some(open) = text[at..].find('{')
        {
            trait_bodies.push(at + open + 1);
        }
    }
    for start in trait_bodies {
        let mut depth = 1;
        let mut end = start;
        for (i, c) in text[start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = start + i;
                break;
            }
        }
        let mut offset = start;
        for line in text[start..end].split_inclusive('\n') {
            let trimmed = line.trim_start();
            let at = offset + (line.len() - trimmed.len());
            offset += line.len();
            let rest = trimmed.strip_prefix("async ").unwrap_or(trimmed);
            if let Some(rest) = rest.strip_prefix("fn ")
                && returns_string_error(signature(text, at))
            {
                found.push((line_of(at), name_of(rest)));
            }
        }
    }
    found
}

fn name_of(rest: &str) -> String {
    rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn no_public_function_of_the_library_returns_a_string_error() {
        let files = library_sources(&workspace());
        assert!(files.len() > 100, "the scan found the library's source ({} files)", files.len());
        let mut offenders = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).expect("source file");
            for (line, name) in string_errors(&text) {
                offenders.push(format!("{}:{line}: {name}", file.display()));
            }
        }
        assert!(offenders.is_empty(), "public functions returning Result<_, String>:\n{}", offenders.join("\n"));
    }

    #[test]
    fn every_spawned_task_is_supervised_or_says_why_not() {
        let mut offenders = Vec::new();
        for file in library_sources(&workspace()) {
            if file.ends_with("supervisor.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).expect("source file");
            for (line, code) in unsupervised_spawns(&text) {
                offenders.push(format!("{}:{line}: {code}", file.display()));
            }
        }
        assert!(
            offenders.is_empty(),
            "tasks spawned outside the supervisor with no `// Not supervised: why` above them:\n{}",
            offenders.join("\n")
        );
    }

    #[test]
    fn the_scan_finds_bare_spawns_where_they_are() {
        let text = "fn a() {\n\
                    \x20   tokio::spawn(forever());\n\
                    \x20   // Not supervised: one connection.\n\
                    \x20   tokio::spawn(conn);\n\
                    \x20   let task = tokio::spawn(run());\n\
                    \x20   supervision.watch(\"run\", task);\n\
                    \x20   set.spawn(async move {});\n\
                    }\n\
                    #[cfg(test)]\nmod tests {\n    fn t() { tokio::spawn(x()); }\n}\n";
        let lines: Vec<usize> = unsupervised_spawns(text).into_iter().map(|(line, _)| line).collect();
        assert_eq!(lines, [2, 7]);
        assert_eq!(bound_name("let mut run = AbortOnDrop(x);"), Some("run"));
        assert_eq!(bound_name("tokio::spawn(x);"), None);
    }

    #[test]
    fn the_scan_finds_string_errors_where_they_are() {
        let text = "pub fn a() -> Result<(), String> {}\n\
                    pub(crate) fn b() -> Result<(), String> {}\n\
                    pub async fn c(\n    x: u8,\n) -> Result<Vec<String>, String>\nwhere T: X {}\n\
                    pub fn d() -> Result<BTreeMap<String, String>, Typed> {}\n\
                    pub trait T {\n    async fn e(&self) -> Result<u8, String>;\n    fn f(&self) -> u8 { 0 }\n}\n\
                    #[cfg(test)]\nmod tests {\n    pub fn g() -> Result<(), String> {}\n}\n";
        let names: Vec<String> = string_errors(text).into_iter().map(|(_, name)| name).collect();
        assert_eq!(names, ["a", "c", "e"]);
        assert_eq!(string_errors(text)[0].0, 1);
    }
}
