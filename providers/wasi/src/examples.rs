//! Small WebAssembly programs, written in WebAssembly text (WAT) and
//! compiled with `wat` when asked for: what the demo runs and what the tests
//! push to registries. Each is a WASI preview 1 command (`_start`) unless
//! said otherwise.
//!
//! | name | does |
//! |---|---|
//! | `hello` | prints its args and env (`arg: ...`, `env: K=V`), writes `hello.txt` into its first preopened directory, exits 0 (1 when it cannot write) |
//! | `sleep` | prints `sleeping`, then sleeps an hour at a time, forever |
//! | `wait` | prints `waiting for go`, looks for a file `go` in its first preopened directory every 10 ms, then prints `got go` and exits 0 |
//! | `check` | prints `running; probe me with check`, then sleeps like `sleep`; run with arguments (an exec probe's fresh instance), exits 0 when a file `healthy` is in its first preopened directory, else prints `not healthy` on stderr and exits 1 |
//! | `talk` | prints `tick` every 200 ms; run with two or more arguments (`kubectl exec`'s fresh instance), copies stdin to stdout until it ends, prints `done` on stderr and exits with the number of arguments less 2 |
//! | `spin` | prints `spinning`, then loops forever without a host call |
//! | `exit3` | prints `exiting with 3` on stderr, exits 3 |
//! | `trap` | prints `about to trap`, executes `unreachable` |
//! | `hog` | prints `allocating`, grows its memory until refused, then traps |
//! | `greedy` | declares 64 MiB of memory at start (1,024 pages), then returns: under a smaller memory limit it cannot be instantiated |
//! | `component-ok` / `component-err` | preview 2 components whose `wasi:cli/run` returns ok / err |

/// WASI imports, memory and the helpers every module shares.
const PRELUDE: &str = r#"
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $environ_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_get" (func $environ_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_close" (func $fd_close (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll_oneoff (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 3)
  ;; 0: iovec, 8: nwritten, 16/20: sizes, 24: opened fd, 64..1024: text,
  ;; 1024: argv pointers, 2048: argv text, 16384: env pointers, 32768: env text.
  (data (i32.const 64) "\n")
  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func $strlen (param $p i32) (result i32) (local $n i32)
    (block $done
      (loop $next
        (br_if $done (i32.eqz (i32.load8_u (i32.add (local.get $p) (local.get $n)))))
        (local.set $n (i32.add (local.get $n) (i32.const 1)))
        (br $next)))
    (local.get $n))
  (func $sleep_forever
    ;; one clock subscription at 256: monotonic, relative, one hour
    (i32.store8 (i32.const 264) (i32.const 0))
    (i32.store (i32.const 272) (i32.const 1))
    (i64.store (i32.const 280) (i64.const 3600000000000))
    (loop $forever
      (drop (call $poll_oneoff (i32.const 256) (i32.const 512) (i32.const 1) (i32.const 600)))
      (br $forever)))
  (func $print_list (param $prefix i32) (param $prefix_len i32) (param $ptrs i32) (param $count i32)
    (local $i i32) (local $s i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $count)))
        (local.set $s (i32.load (i32.add (local.get $ptrs) (i32.shl (local.get $i) (i32.const 2)))))
        (call $write (i32.const 1) (local.get $prefix) (local.get $prefix_len))
        (call $write (i32.const 1) (local.get $s) (call $strlen (local.get $s)))
        (call $write (i32.const 1) (i32.const 64) (i32.const 1))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next))))
"#;

fn module(body: &str) -> String {
    format!("(module {PRELUDE} {body})")
}

/// The WAT text of the example `name`.
pub(crate) fn text(name: &str) -> Option<String> {
    let text = match name {
        "hello" => module(
            r#"
  (data (i32.const 80) "arg: ")
  (data (i32.const 88) "env: ")
  (data (i32.const 96) "hello.txt")
  (data (i32.const 112) "hello from a WebAssembly module\n")
  (data (i32.const 160) "wrote hello.txt into my first volume\n")
  (data (i32.const 208) "cannot write hello.txt into my first volume\n")
  (func (export "_start") (local $fd i32)
    (drop (call $args_sizes_get (i32.const 16) (i32.const 20)))
    (drop (call $args_get (i32.const 1024) (i32.const 2048)))
    (call $print_list (i32.const 80) (i32.const 5) (i32.const 1024) (i32.load (i32.const 16)))
    (drop (call $environ_sizes_get (i32.const 16) (i32.const 20)))
    (drop (call $environ_get (i32.const 16384) (i32.const 32768)))
    (call $print_list (i32.const 88) (i32.const 5) (i32.const 16384) (i32.load (i32.const 16)))
    ;; O_CREAT|O_TRUNC, rights: datasync..write
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 96) (i32.const 9) (i32.const 9)
                         (i64.const 0x7f) (i64.const 0) (i32.const 0) (i32.const 24))
      (then
        (call $write (i32.const 2) (i32.const 208) (i32.const 44))
        (call $proc_exit (i32.const 1))))
    (local.set $fd (i32.load (i32.const 24)))
    (call $write (local.get $fd) (i32.const 112) (i32.const 32))
    (drop (call $fd_close (local.get $fd)))
    (call $write (i32.const 1) (i32.const 160) (i32.const 37)))
"#,
        ),
        "sleep" => module(
            r#"
  (data (i32.const 80) "sleeping\n")
  (func (export "_start")
    (call $write (i32.const 1) (i32.const 80) (i32.const 9))
    (call $sleep_forever))
"#,
        ),
        "wait" => module(
            r#"
  (data (i32.const 80) "waiting for go\n")
  (data (i32.const 96) "go")
  (data (i32.const 112) "got go\n")
  (func (export "_start")
    (call $write (i32.const 1) (i32.const 80) (i32.const 15))
    ;; one clock subscription at 256: monotonic, relative, 10 ms
    (i32.store8 (i32.const 264) (i32.const 0))
    (i32.store (i32.const 272) (i32.const 1))
    (i64.store (i32.const 280) (i64.const 10000000))
    ;; path_open answers 0 once the file is there
    (block $found
      (loop $again
        (br_if $found (i32.eqz (call $path_open (i32.const 3) (i32.const 0) (i32.const 96) (i32.const 2)
                                                (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 24))))
        (drop (call $poll_oneoff (i32.const 256) (i32.const 512) (i32.const 1) (i32.const 600)))
        (br $again)))
    (call $write (i32.const 1) (i32.const 112) (i32.const 7)))
"#,
        ),
        "check" => module(
            r#"
  (data (i32.const 80) "running; probe me with check\n")
  (data (i32.const 112) "healthy")
  (data (i32.const 128) "not healthy\n")
  (func (export "_start")
    (drop (call $args_sizes_get (i32.const 16) (i32.const 20)))
    (if (i32.ge_u (i32.load (i32.const 16)) (i32.const 2))
      (then
        (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 112) (i32.const 7)
                             (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 24))
          (then
            (call $write (i32.const 2) (i32.const 128) (i32.const 12))
            (call $proc_exit (i32.const 1))))
        (call $proc_exit (i32.const 0))))
    (call $write (i32.const 1) (i32.const 80) (i32.const 29))
    (call $sleep_forever))
"#,
        ),
        "talk" => module(
            r#"
  (data (i32.const 80) "tick\n")
  (data (i32.const 96) "done\n")
  (func (export "_start") (local $n i32)
    (drop (call $args_sizes_get (i32.const 16) (i32.const 20)))
    (if (i32.ge_u (i32.load (i32.const 16)) (i32.const 2))
      (then
        ;; iovec at 4096 over a 4 KiB buffer at 8192; bytes read at 4104
        (block $eof
          (loop $more
            (i32.store (i32.const 4096) (i32.const 8192))
            (i32.store (i32.const 4100) (i32.const 4096))
            (br_if $eof (call $fd_read (i32.const 0) (i32.const 4096) (i32.const 1) (i32.const 4104)))
            (local.set $n (i32.load (i32.const 4104)))
            (br_if $eof (i32.eqz (local.get $n)))
            (call $write (i32.const 1) (i32.const 8192) (local.get $n))
            (br $more)))
        (call $write (i32.const 2) (i32.const 96) (i32.const 5))
        (call $proc_exit (i32.sub (i32.load (i32.const 16)) (i32.const 2)))))
    ;; one clock subscription at 256: monotonic, relative, 200 ms
    (i32.store8 (i32.const 264) (i32.const 0))
    (i32.store (i32.const 272) (i32.const 1))
    (i64.store (i32.const 280) (i64.const 200000000))
    (loop $forever
      (call $write (i32.const 1) (i32.const 80) (i32.const 5))
      (drop (call $poll_oneoff (i32.const 256) (i32.const 512) (i32.const 1) (i32.const 600)))
      (br $forever)))
"#,
        ),
        "spin" => module(
            r#"
  (data (i32.const 80) "spinning\n")
  (func (export "_start")
    (call $write (i32.const 1) (i32.const 80) (i32.const 9))
    (loop $forever (br $forever)))
"#,
        ),
        "exit3" => module(
            r#"
  (data (i32.const 80) "exiting with 3\n")
  (func (export "_start")
    (call $write (i32.const 2) (i32.const 80) (i32.const 15))
    (call $proc_exit (i32.const 3)))
"#,
        ),
        "trap" => module(
            r#"
  (data (i32.const 80) "about to trap\n")
  (func (export "_start")
    (call $write (i32.const 1) (i32.const 80) (i32.const 14))
    unreachable)
"#,
        ),
        "hog" => module(
            r#"
  (data (i32.const 80) "allocating\n")
  (func (export "_start")
    (call $write (i32.const 1) (i32.const 80) (i32.const 11))
    (loop $more
      (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable)
"#,
        ),
        "greedy" => r#"(module (memory (export "memory") 1024) (func (export "_start")))"#.to_owned(),
        "component-ok" | "component-err" => {
            let result = if name == "component-ok" { 0 } else { 1 };
            format!(
                r#"(component
  (core module $m (func (export "run") (result i32) i32.const {result}))
  (core instance $i (instantiate $m))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $run_instance (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $run_instance)))"#
            )
        }
        _ => return None,
    };
    Some(text)
}

/// Why an example could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ExampleError {
    /// There is no example of that name.
    #[error("no example module {0:?}")]
    Unknown(String),
    /// Its text did not assemble.
    #[error("example {name}: {reason}")]
    Invalid {
        /// The example.
        name: String,
        /// The assembler's message.
        reason: String,
    },
}

/// The binary of the example `name`.
pub fn binary(name: &str) -> Result<Vec<u8>, ExampleError> {
    let text = text(name).ok_or_else(|| ExampleError::Unknown(name.to_owned()))?;
    wat::parse_str(&text).map_err(|e| ExampleError::Invalid { name: name.to_owned(), reason: e.to_string() })
}

/// Every example's name.
pub const NAMES: &[&str] = &[
    "hello",
    "sleep",
    "wait",
    "check",
    "talk",
    "spin",
    "exit3",
    "trap",
    "hog",
    "greedy",
    "component-ok",
    "component-err",
];

#[cfg(test)]
mod tests {
    #[test]
    fn every_example_assembles() {
        for name in super::NAMES {
            let binary = super::binary(name).expect("assembles");
            assert!(crate::store::ModuleKind::detect(&binary).is_some(), "{name}");
        }
    }
}
