//! One build, any machine (issue #45): the CUDA build of `folio` starts and answers where no GPU
//! can be used, says why, and refuses a GPU asked for by name with that reason; where a GPU can
//! be used it lists it and runs on it. Built with `--features cuda` only; the test command's
//! CUDA step runs it on this GPU-less machine, the GPU machine's runs (docs/install.md) there.
#![cfg(feature = "cuda")]

#[path = "common/cli.rs"]
mod cli;

use std::path::Path;
use std::process::{Command, Output};

use cli::{demo, docs, err_text, ok_json, test_home};

/// `folio ARGS` as a person runs it: no `--device`, so the build picks.
fn folio_auto(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_folio")).args(args).env("FOLIO_HOME", test_home()).output().unwrap()
}

/// Whether an NVIDIA driver is loaded on this machine, asked of the kernel, not of Folio.
fn driver_loaded() -> bool {
    Path::new("/proc/driver/nvidia/version").exists()
}

#[test]
fn the_cuda_build_runs_where_it_can_and_says_why_not_where_it_cannot() {
    let info = ok_json(folio_auto(&["info", "--model", &demo(), "--json"]));
    let dir = docs(1);
    let out = dir.path().join("samples.folio");
    let (d, o, m) = (dir.path().display().to_string(), out.display().to_string(), demo());
    ok_json(folio_auto(&["prefill", "--model", &m, "--docs", &d, "--out", &o, "--json"]));
    let answer = ok_json(folio_auto(&[
        "chat",
        "--context",
        &o,
        "what is the room number of silver otter ?",
        "--temperature",
        "0",
        "--json",
    ]));
    assert!(answer.to_string().contains("3 0 7 1 9"), "{answer}");
    if driver_loaded() {
        // A driver is loaded: the GPU runs, or the reason is about the toolkit, the driver's
        // version or the GPU — never that there is no driver.
        match info["gpu"].as_array() {
            Some(gpus) => {
                assert!(!gpus.is_empty(), "{info}");
                assert_eq!(info["device"], "cuda", "{info}");
            }
            None => {
                let why = info["gpu"]["unavailable"].as_str().unwrap_or_else(|| panic!("no reason given: {info}"));
                assert!(!why.starts_with("no NVIDIA driver found"), "{why}");
                assert_eq!(info["device"], "cpu", "{info}");
            }
        }
    } else {
        let why = info["gpu"]["unavailable"].as_str().unwrap_or_else(|| panic!("no reason given: {info}"));
        assert!(why.starts_with("no NVIDIA driver found (libcuda.so"), "{why}");
        assert_eq!(info["device"], "cpu", "{info}");
        let refused = err_text(folio_auto(&["info", "--model", &demo(), "--device", "cuda"]));
        assert!(refused.contains("device cuda asked for, but no NVIDIA driver found"), "{refused}");
    }
}
