//! Compiles the crate's cuda/*.cu to PTX with nvcc when the `cuda` feature is on (kernels/ and,
//! through its `build` key, method-kernels/); the PTX is
//! embedded in the crate and loaded by candle's CUDA device at first use. CPU builds need no
//! CUDA toolkit. The target is `compute_$CUDA_COMPUTE_CAP`, default 80: PTX for a virtual
//! architecture is JIT-compiled by the driver on that architecture and newer ones (Ampere,
//! Ada, Hopper, Blackwell), never older; scripts/cuda-toolchain.sh keeps 80 unless told otherwise,
//! so one binary serves every GPU from 8.0 on.
//! 80 is also the floor: the prefill kernel (flash.cu) needs bf16 `mma.sync` and `cp.async`.
//! A file named `*_sm90a.cu` uses Hopper-only instructions (`wgmma`) and is always compiled for
//! `compute_90a`, whatever the target: it is loaded only on a device of compute capability 9.0.
//! `*.cuh` files are code the kernels share (included, not compiled on their own).

use std::path::PathBuf;
use std::process::Command;

const DEFAULT_COMPUTE_CAP: &str = "80";
/// Sources whose stem ends so are Hopper-only, compiled for [`HOPPER_ARCH`].
const HOPPER_SUFFIX: &str = "_sm90a";
const HOPPER_ARCH: &str = "compute_90a";

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    // A crate that builds with this script (method-kernels) includes the kernels' shared headers.
    println!("cargo:rerun-if-changed=../kernels/cuda");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| DEFAULT_COMPUTE_CAP.into());
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    for entry in std::fs::read_dir("cuda").expect("kernels/cuda exists") {
        let src = entry.expect("readable kernels/cuda").path();
        if src.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let ptx = out.join(src.with_extension("ptx").file_name().expect("a file name"));
        let hopper = src.file_stem().and_then(|s| s.to_str()).is_some_and(|s| s.ends_with(HOPPER_SUFFIX));
        let arch = if hopper { HOPPER_ARCH.to_owned() } else { format!("compute_{cap}") };
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch={arch}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e} (source scripts/cuda-toolchain.sh)", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
