# Verbs a contributor uses. Every recipe is a plain cargo command, so nothing
# here needs `just` itself: copy the line if `just` is not installed.

# Build everything.
build:
    cargo build --workspace

# Run the whole test suite (the README's second command; CI runs .ci/run).
test:
    cargo xtask test

# Formatting and lints, as CI checks them.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# The standalone demo (the README's first command), until Ctrl-C.
demo:
    cargo run -p rustlet -- demo

# Benchmarks: print figures (release build).
bench:
    cargo bench -p rustlet --bench registration
    cargo bench -p rustlet --bench device_plugins
    cargo bench -p rustlet --bench device_allocation
    cargo bench -p rustlet --bench pods
    cargo bench -p rustlet --bench wasm
    cargo bench -p rustlet --bench cluster
    cargo bench -p rustlet --bench cri
    cargo bench -p rustlet --bench kubelet_api
    cargo bench -p rustlet --bench dra
    cargo bench -p rustlet --bench density

# The scale benchmark: N node processes against a real control plane
# (docs/benchmarks.md#scale; needs RUSTLET_KUBE_BIN_DIR).
bench-scale:
    cargo bench -p rustlet --bench scale

# The end-to-end scenario against an existing cluster (docs/cluster.md):
# give an administrator's kubeconfig.
e2e kubeconfig:
    RUSTLET_E2E_KUBECONFIG={{kubeconfig}} cargo test -p rustlet --test e2e -- --nocapture
