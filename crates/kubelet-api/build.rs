//! Compiles the contracts in `proto/` with protox (pure Rust), so a fresh clone
//! builds with `cargo build` alone: no system `protoc` is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "pluginregistration/v1/api.proto",
        "deviceplugin/v1beta1/api.proto",
        "csi/v1/csi.proto",
        "runtime/v1/api.proto",
        "health/v1/health.proto",
        "dra/v1/api.proto",
        "dra/v1beta1/api.proto",
        "podresources/v1/api.proto",
    ];
    for file in &files {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }
    let descriptors = protox::compile(files, [&proto_root])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
