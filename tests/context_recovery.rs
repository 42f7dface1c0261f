//! Context files that do not finish as planned, through the `folio` binary: kill -9 and Ctrl-C
//! mid-prefill resume to a byte-identical file, an interrupted change is finished by the
//! context alone, lost checkpoint bytes restart the prefill, corruption is named by section, the
//! wrong model and an over-long collection are refused up front, a full disk leaves nothing
//! behind, and hostile output paths are refused with what they are. Real processes and signals.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{demo, docs, err_text, folio, folio_cmd, ok_json, prefill, root};

enum KillAt {
    /// As soon as the first layer is under way (no checkpoint of a finished layer yet).
    FirstLayer,
    /// Once this many layers are checkpointed.
    LayersDone(u64),
}

/// Waits for the kill point, then sends `signal` (SIGKILL, or SIGINT: Ctrl-C) to the child.
/// Returns whether it was stopped mid-way (false when it finished first).
fn kill_at(mut child: Child, partial: &Path, at: KillAt, signal: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        let done = std::fs::read_to_string(partial.join("checkpoint.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["layers_done"].as_u64());
        let reached = match at {
            KillAt::FirstLayer => done == Some(0),
            KillAt::LayersDone(n) => done.is_some_and(|d| d >= n),
        };
        if reached || Instant::now() > deadline {
            // SAFETY: signalling our own child, which has not been waited for (its pid is live).
            unsafe { libc::kill(child.id() as i32, signal) };
            let out = child.wait_with_output().unwrap();
            if signal == libc::SIGINT {
                // Ctrl-C: a clean stop after the current chunk, checkpoint kept, told how to resume.
                let stderr = err_text(out);
                assert!(stderr.contains("cancelled") && stderr.contains("run the same command again"), "{stderr}");
            }
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// kill -9 (and one Ctrl-C) at several points of a prefill, rerun each time: the rerun
/// resumes, and the final file is byte-identical to an uninterrupted prefill's.
#[test]
fn killed_prefill_resumes_to_an_identical_file() {
    let d = docs(10);
    let work = tempfile::tempdir().unwrap();
    let whole = work.path().join("whole.folio");
    let started = Instant::now();
    let report = ok_json(prefill(d.path(), &whole, &[]));
    println!("uninterrupted: {} tokens in {:.1?}", report["report"]["tokens"], started.elapsed());

    let out = work.path().join("killed.folio");
    let partial = PathBuf::from(format!("{}.partial", out.display()));
    let (dp, op) = (d.path().display().to_string(), out.display().to_string());
    let args = ["prefill", "--model", &demo(), "--docs", &dp, "--out", &op, "--json"];
    let mut landed = 0;
    let points = [
        (KillAt::FirstLayer, libc::SIGKILL),
        (KillAt::LayersDone(1), libc::SIGKILL),
        (KillAt::LayersDone(2), libc::SIGINT),
        (KillAt::LayersDone(3), libc::SIGKILL),
    ];
    for (at, signal) in points {
        let child = folio_cmd(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        if kill_at(child, &partial, at, signal) {
            landed += 1;
            assert!(!out.exists(), "a killed prefill never leaves a finished-looking file");
        }
    }
    assert!(landed >= 3, "only {landed} of 4 kills landed before the prefill finished");
    // The library lists it where it stopped.
    let listed = ok_json(folio(&["library", "show", &op, "--json"]));
    assert_eq!(
        (listed["context"]["status"].as_str(), listed["context"]["layers_done"].as_u64()),
        (Some("paused"), Some(3))
    );
    // A rerun that does not match (another K/V dtype) is refused and leaves the progress alone.
    let mut other = args.to_vec();
    other.extend(["--kv-dtype", "fp8"]);
    let err = err_text(folio(&other));
    assert!(err.contains("does not match") && err.contains("--restart"), "{err}");
    assert!(partial.join("checkpoint.json").exists(), "a refused resume keeps the interrupted prefill");
    let resumed = ok_json(folio(&args));
    assert_eq!(resumed["report"]["resumed_layers"], 3, "the last kill was in layer 3: {resumed}");
    assert!(!partial.exists(), "the partial folder is removed after success");
    assert_eq!(ok_json(folio(&["library", "show", &op, "--json"]))["context"]["status"], "ready");
    assert!(
        std::fs::read(&whole).unwrap() == std::fs::read(&out).unwrap(),
        "resumed file differs from the uninterrupted one"
    );
}

/// An addition killed mid-prefill leaves the context as it was (it opens, listed ready with a
/// change pending); `folio prefill --context F` alone finishes it from the checkpoint, and the
/// file is the one the addition makes uninterrupted (byte for byte, f32). With nothing to
/// finish, it says what --context needs.
#[test]
fn an_interrupted_change_is_finished_by_context_alone() {
    let small = docs(1);
    let work = tempfile::tempdir().unwrap();
    let big = work.path().join("big.txt");
    let text = std::fs::read_to_string(root().join("assets/samples/market_records.txt")).unwrap();
    std::fs::write(&big, text.repeat(12)).unwrap();
    let (m, first) = (demo(), small.path().join("field_notes.txt").display().to_string());
    let (grown, whole) = (work.path().join("grown.folio"), work.path().join("whole.folio"));
    let (g, w, b) = (grown.display().to_string(), whole.display().to_string(), big.display().to_string());
    ok_json(folio(&["prefill", "--model", &m, "--docs", &first, "--out", &g, "--kv-dtype", "f32", "--json"]));
    let saved = std::fs::read(&grown).unwrap();
    let err = err_text(folio(&["prefill", "--context", &g]));
    assert!(err.contains("--context needs --add") && err.contains("no interrupted change"), "{err}");
    // The addition uninterrupted, written elsewhere.
    ok_json(folio(&["prefill", "--context", &g, "--add", &b, "--out", &w, "--json"]));

    let partial = PathBuf::from(format!("{g}.partial"));
    let child = folio_cmd(&["prefill", "--context", &g, "--add", &b, "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(kill_at(child, &partial, KillAt::LayersDone(1), libc::SIGKILL), "the addition finished before the kill");
    assert!(std::fs::read(&grown).unwrap() == saved, "an interrupted change leaves the file as it was");
    let listed = ok_json(folio(&["library", "show", &g, "--json"]));
    let status = (listed["context"]["status"].as_str(), listed["context"]["change_pending"].as_bool());
    assert_eq!(status, (Some("ready"), Some(true)), "{listed}");

    let finished = ok_json(folio(&["prefill", "--context", &g, "--json"]));
    assert!(finished["report"]["resumed_layers"].as_u64() >= Some(1), "{finished}");
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&grown).unwrap(), "finished != uninterrupted");
    let listed = ok_json(folio(&["library", "show", &g, "--json"]));
    assert_eq!(listed["context"]["change_pending"].as_bool(), Some(false));
}

/// A resume under a budget its pinned chunk no longer fits is refused. Checkpoints do not
/// wait for the disk, so they name checksums instead: bytes a checkpoint vouches for that did
/// not survive (here, one flipped in the hidden states the next layer reads, as a power cut
/// could leave them) make the rerun start over, and the file it makes is still the
/// uninterrupted one.
#[test]
fn lost_checkpoint_bytes_restart_the_prefill() {
    let d = docs(4);
    let work = tempfile::tempdir().unwrap();
    let whole = work.path().join("whole.folio");
    let report = ok_json(prefill(d.path(), &whole, &[]));
    let out = work.path().join("lost.folio");
    let partial = PathBuf::from(format!("{}.partial", out.display()));
    let (dp, op) = (d.path().display().to_string(), out.display().to_string());
    let args = ["prefill", "--model", &demo(), "--docs", &dp, "--out", &op, "--json"];
    let child = folio_cmd(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    assert!(kill_at(child, &partial, KillAt::LayersDone(2), libc::SIGKILL), "the prefill finished before the kill");
    let cp: Value = serde_json::from_str(&std::fs::read_to_string(partial.join("checkpoint.json")).unwrap()).unwrap();
    let done = cp["layers_done"].as_u64().unwrap();
    assert!(done >= 2, "{cp}");
    // A resume keeps the chunk it started with: a budget that chunk no longer fits is refused
    // up front, and the interrupted prefill stays.
    let tight = (report["report"]["working_set_bytes"].as_u64().unwrap() - 1024).to_string();
    let mut squeezed = args.to_vec();
    squeezed.extend(["--memory-budget", &tight]);
    let err = err_text(folio(&squeezed));
    assert!(err.contains("resumes in chunks of") && err.contains("--restart"), "{err}");
    assert!(partial.join("checkpoint.json").exists(), "a refused resume keeps the interrupted prefill");
    // Layer `done - 1` wrote hidden-{(done - 1) % 2}.bin, which the next layer reads.
    let hidden = partial.join(format!("hidden-{}.bin", (done - 1) % 2));
    let mut bytes = std::fs::read(&hidden).unwrap();
    bytes[17] ^= 0x40;
    std::fs::write(&hidden, &bytes).unwrap();
    let rerun = ok_json(folio(&args));
    assert_eq!(rerun["report"]["resumed_layers"], 0, "resumed from damaged hidden states: {rerun}");
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&out).unwrap(), "the restarted file differs");
    // With --restart the tight budget plans the prefill anew (smaller chunks) and finishes.
    std::fs::remove_file(&out).unwrap();
    let child = folio_cmd(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    assert!(kill_at(child, &partial, KillAt::LayersDone(1), libc::SIGKILL), "the prefill finished before the kill");
    squeezed.push("--restart");
    let replanned = ok_json(folio(&squeezed));
    assert_eq!(replanned["report"]["resumed_layers"], 0, "{replanned}");
    assert!(replanned["report"]["chunk"].as_u64() < report["report"]["chunk"].as_u64(), "{replanned}");
}

/// Flip one byte in each section type, truncate, or hand over a non-context: each gives its
/// own clear error from `context info --verify` (and from `chat`, which reads every layer).
#[test]
fn corruption_is_reported_by_section() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("c.folio");
    ok_json(prefill(d.path(), &ctx, &[]));
    let info = ok_json(folio(&["context", "info", ctx.to_str().unwrap(), "--json"]));
    let sections = info["sections"].as_array().unwrap();
    let offset = |kind: &str, layer: Option<u64>| -> usize {
        let s = sections.iter().find(|s| s["kind"] == kind && s["layer"].as_u64() == layer).unwrap();
        (s["offset"].as_u64().unwrap() + s["bytes"].as_u64().unwrap() / 2) as usize
    };
    let good = std::fs::read(&ctx).unwrap();
    let flip = |at: usize| {
        let mut b = good.clone();
        b[at] ^= 0x5a;
        b
    };
    let cases: Vec<(&str, Vec<u8>, &str, bool)> = vec![
        ("tiny", good[..20].to_vec(), "not a Folio context file (only 20 bytes)", true),
        ("half", good[..good.len() / 2].to_vec(), "truncated", true),
        ("magic", flip(0), "not a Folio context file", true),
        ("header", flip(40), "the header is corrupted", true),
        ("tokens", flip(offset("tokens", None)), "section \"tokens\" is corrupted", true),
        ("documents", flip(offset("documents", None)), "section \"documents\" is corrupted", true),
        ("keys", flip(offset("keys", Some(0))), "section \"keys of layer 0\" is corrupted", false),
        ("values", flip(offset("values", Some(3))), "section \"values of layer 3\" is corrupted", false),
        ("text", b"just some notes, not a context\n".to_vec(), "not a Folio context file", true),
    ];
    for (name, bytes, expected, at_open) in cases {
        let path = work.path().join(format!("{name}.folio"));
        std::fs::write(&path, bytes).unwrap();
        let p = path.to_str().unwrap();
        let err = err_text(folio(&["context", "info", p, "--verify"]));
        assert!(err.contains(expected) && err.contains(p), "{name}: {err}");
        let plain = folio(&["context", "info", p]);
        assert_eq!(plain.status.success(), !at_open, "{name}: open-time checks cover the small sections only");
        let err = err_text(folio(&["chat", "--context", p, "--model", &demo(), "hello"]));
        assert!(err.contains(expected), "{name} (chat): {err}");
    }
}

#[test]
fn another_model_is_refused_by_name() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("c.folio");
    ok_json(prefill(d.path(), &ctx, &[]));
    let llama = root().join("tests/fixtures/models/llama").display().to_string();
    let err = err_text(folio(&["chat", "--context", ctx.to_str().unwrap(), "--model", &llama, "hi"]));
    assert!(err.contains("made with model demo") && err.contains("--model"), "{err}");
}

/// A file-size limit (RLIMIT_FSIZE, what a full disk looks like to one process) below the
/// context's size: a clear error, no partial file, and the previous file at `--out` intact.
#[test]
fn full_disk_leaves_nothing_behind() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("c.folio");
    // The previous context at --out (Folio replaces only a context file there).
    let small = tempfile::tempdir().unwrap();
    std::fs::write(small.path().join("note.txt"), "a short note").unwrap();
    assert!(prefill(small.path(), &out, &["--no-library"]).status.success());
    let previous = std::fs::read(&out).unwrap();
    let (dp, op) = (d.path().display().to_string(), out.display().to_string());
    let mut cmd = folio_cmd(&["prefill", "--model", &demo(), "--docs", &dp, "--out", &op]);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 256 << 10, rlim_max: 256 << 10 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let run = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(!run.status.success(), "the prefill fit under the limit: {stdout}");
    let err = err_text(run);
    assert!(err.contains("not enough disk space") && err.contains("Nothing was kept"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), previous);
    let names: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["c.folio"], "nothing else is left");
    // The library lists only what is there: the previous context, if anything (a failed
    // prefill brings the listing up to date with the file at --out).
    let shown = folio(&["library", "show", &op, "--json"]);
    if shown.status.success() {
        let listed: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
        assert!(
            listed.to_string().contains("\"tokens\":") && !listed.to_string().contains("\"tokens\":723"),
            "{listed}"
        );
    } else {
        assert!(err_text(shown).contains("no context"));
    }
}

/// More tokens than the model's context: refused before any prefill work, with the count of
/// each document and the limit.
#[test]
fn over_long_collection_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("short.txt"), "a short note").unwrap();
    std::fs::write(dir.path().join("long.txt"), "many words here ".repeat(400)).unwrap();
    let out = dir.path().join("c.folio");
    let llama = root().join("tests/fixtures/models/llama").display().to_string();
    let (dp, op) = (dir.path().display().to_string(), out.display().to_string());
    let started = Instant::now();
    let err = err_text(folio(&["prefill", "--model", &llama, "--docs", &dp, "--out", &op]));
    for needle in ["long.txt", "short.txt", "tokens", "512", "nothing was prefilled"] {
        assert!(err.contains(needle), "missing {needle}: {err}");
    }
    assert!(!out.exists() && !PathBuf::from(format!("{op}.partial")).exists());
    println!("refused in {:.2?}", started.elapsed());
}

/// Hostile paths found by trying: an output that is a named pipe or a device is refused before
/// any compute (an atomic rename would have replaced it with a regular file), a context
/// "file" that is a folder says so, bytes appended to a context fail `--verify`, and an OS
/// error is said once.
#[test]
fn hostile_paths_are_refused_with_what_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.folio");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let e = err_text(prefill(&root().join("assets/samples"), &fifo, &[]));
    assert!(e.contains("pipe.folio is a named pipe, not a file"), "{e}");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&std::fs::symlink_metadata(&fifo).unwrap().file_type()));
    let e = err_text(prefill(&root().join("assets/samples"), Path::new("/dev/null"), &[]));
    assert!(e.contains("/dev/null is a device, not a file"), "{e}");
    let link = dir.path().join("link.folio");
    std::os::unix::fs::symlink(dir.path().join("elsewhere.folio"), &link).unwrap();
    let e = err_text(prefill(&root().join("assets/samples"), &link, &[]));
    assert!(e.contains("is a symbolic link (to ") && e.contains("name the target itself"), "{e}");

    let e = err_text(folio(&["chat", "--context", dir.path().to_str().unwrap(), "hello"]));
    assert!(e.contains("a folder, not a context file"), "{e}");
    assert!(!e.contains("No such device"), "{e}");

    let ctx = dir.path().join("s.folio");
    ok_json(prefill(&root().join("assets/samples"), &ctx, &[]));
    let mut f = std::fs::OpenOptions::new().append(true).open(&ctx).unwrap();
    std::io::Write::write_all(&mut f, b"appended").unwrap();
    let e = err_text(folio(&["context", "info", ctx.to_str().unwrap(), "--verify"]));
    assert!(e.contains("8 bytes after the last section"), "{e}");

    let e = err_text(folio(&["context", "info", "/proc/1/mem/missing.folio"]));
    assert_eq!(e.matches("os error").count(), 0, "{e}");
    assert_eq!(e.to_lowercase().matches("not a directory").count(), 1, "{e}");
}
