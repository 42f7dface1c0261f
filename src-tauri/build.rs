//! Builds the Svelte UI (ui/ → ui/dist) before Tauri embeds it, so `cargo build` alone produces
//! a working desktop binary. Without the `gui` feature there is nothing to build.

fn main() {
    #[cfg(feature = "gui")]
    {
        build_ui();
        tauri_build::build();
    }
}

#[cfg(feature = "gui")]
fn build_ui() {
    use std::path::Path;
    use std::process::Command;

    // Read at run time, not with env!(): a build script binary cached in a shared target dir
    // is reused by clones at other paths, and a baked-in path would point at the old clone.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let ui = Path::new(&manifest_dir).join("../ui");
    for input in ["src", "index.html", "package.json", "package-lock.json", "vite.config.ts", "tsconfig.json"] {
        println!("cargo:rerun-if-changed={}", ui.join(input).display());
    }
    let npm = |args: &[&str]| {
        let status = Command::new("npm").args(args).current_dir(&ui).status().unwrap_or_else(|e| {
            panic!("could not run npm ({e}): the desktop UI needs Node.js 20+ and npm (see README.md)")
        });
        assert!(status.success(), "`npm {}` in {} failed", args.join(" "), ui.display());
    };
    if !ui.join("node_modules").is_dir() {
        npm(&["ci", "--no-audit", "--no-fund"]);
    }
    npm(&["run", "build"]);
}
