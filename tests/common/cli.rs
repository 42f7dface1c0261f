//! What the tests of the `folio` binary over context files share: the repository's demo model
//! and samples, a test library per process (never the user's), runs of the binary on the CPU,
//! and how a success (JSON) and a failure (a clean error, never a panic) read.
#![allow(dead_code)] // each test file uses its own share of these

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn demo() -> String {
    root().join("assets/models/demo").display().to_string()
}

/// The library these runs register contexts in (`folio prefill` lists what it makes): one per
/// test process, never the user's.
pub fn test_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("home-{}", std::process::id()))
}

pub fn folio_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_folio"));
    cmd.args(args).args(["--device", "cpu"]).env("FOLIO_HOME", test_home());
    cmd
}

pub fn folio(args: &[&str]) -> Output {
    folio_cmd(args).output().expect("run folio")
}

pub fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The error of a failed run: exit code 1 (an error), or 2 (a bad argument, refused by the
/// argument parser), not a panic's 101, and its message.
pub fn err_text(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(matches!(out.status.code(), Some(1 | 2)), "expected a clean error, got {:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// The sample documents (demo-model prose), `copies` times over, in a fresh folder, plus a
/// hidden file and a binary file that prefill must skip.
pub fn docs(copies: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let samples = root().join("assets/samples");
    for name in ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"] {
        let text = std::fs::read_to_string(samples.join(name)).unwrap();
        std::fs::write(dir.path().join(name), text.repeat(copies)).unwrap();
    }
    std::fs::write(dir.path().join(".notes.txt"), "hidden").unwrap();
    std::fs::write(dir.path().join("photo.jpg"), [0xff, 0xd8, 0xff, 0, 0x10]).unwrap();
    dir
}

pub fn prefill(docs: &Path, out: &Path, extra: &[&str]) -> Output {
    let (d, o, m) = (docs.display().to_string(), out.display().to_string(), demo());
    let mut args = vec!["prefill", "--model", &m, "--docs", &d, "--out", &o, "--json"];
    args.extend_from_slice(extra);
    folio(&args)
}
