//! `rustlet images import|list|rm`: the node's WebAssembly image store,
//! managed directly under the root dir (the node need not run; a running
//! node sees the changes at its next container start).

use anyhow::{Context, bail};
use rustlet_wasi::store::ImageStore;

use crate::cli::ImagesCommand;

pub(crate) fn run(command: ImagesCommand) -> anyhow::Result<()> {
    match command {
        ImagesCommand::Import { source, base_name, node } => {
            let store = ImageStore::open(&node.root_dir)?;
            let imported = rustlet_wasi::import::import(&store, &source, base_name.as_deref())
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("cannot import {}", source.display()))?;
            for image in imported {
                println!("imported {} ({}, {} bytes, {})", image.name, short(&image.id), image.size, kind(&image));
            }
            Ok(())
        }
        ImagesCommand::List { quiet, node } => {
            let store = ImageStore::open(&node.root_dir)?;
            let images = store.list()?;
            if quiet {
                for image in images {
                    println!("{}", image.name);
                }
                return Ok(());
            }
            let rows: Vec<[String; 6]> = images
                .iter()
                .map(|i| {
                    [
                        i.name.clone(),
                        short(&i.id).to_owned(),
                        kind(i).to_owned(),
                        human_size(i.size),
                        if i.imported { "imported" } else { "pulled" }.to_owned(),
                        i.last_used.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                    ]
                })
                .collect();
            let header = ["REF", "IMAGE ID", "TYPE", "SIZE", "SOURCE", "LAST USED"].map(String::from);
            let mut widths = header.clone().map(|h| h.len());
            for row in &rows {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.len());
                }
            }
            for row in std::iter::once(&header).chain(&rows) {
                let line: Vec<String> = row.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
                println!("{}", line.join("   ").trim_end());
            }
            Ok(())
        }
        ImagesCommand::Rm { images, node } => {
            let store = ImageStore::open(&node.root_dir)?;
            let mut missing = Vec::new();
            for name in &images {
                let removed = store.remove(name)?;
                if removed.is_empty() {
                    missing.push(name.clone());
                }
                for image in removed {
                    println!("removed {} ({})", image.name, short(&image.id));
                }
            }
            if !missing.is_empty() {
                bail!("no such image: {}", missing.join(", "));
            }
            Ok(())
        }
    }
}

fn short(id: &str) -> &str {
    let hex = id.trim_start_matches("sha256:");
    hex.get(..12).unwrap_or(hex)
}

fn kind(image: &rustlet_wasi::store::ImageRecord) -> &'static str {
    match image.kind {
        rustlet_wasi::store::ModuleKind::Module => "wasm module",
        rustlet_wasi::store::ModuleKind::Component => "wasm component",
    }
}

fn human_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / f64::from(1 << 20)),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
