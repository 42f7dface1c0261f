//! Hostile input (issue #50): each case the way a person or a crafted file meets Folio, run as
//! its own `folio` process under a memory limit (RLIMIT_AS) and a time limit, with the message
//! it must give. No panic, no silent loss, no half-written state, no hang, no runaway.

#[path = "common/cli.rs"]
mod cli;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use cli::{demo, docs, folio_cmd, prefill, root};

/// Address space each case may take: far above what the tiny models need, far below a
/// runaway's.
const MEMORY_LIMIT: u64 = 4 << 30;
/// What a case may take before it counts as a hang.
const TIME_LIMIT: Duration = Duration::from_secs(60);

/// Runs `cmd` under the limits: its output, or a failed test if it ran out of time.
fn limited(mut cmd: Command) -> Output {
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: MEMORY_LIMIT, rlim_max: MEMORY_LIMIT };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > TIME_LIMIT {
            child.kill().unwrap();
            panic!("{cmd:?} ran past {TIME_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The message of a refused case: a clean error (exit 1 or 2, no panic) that says `says`.
fn refused(out: Output, says: &str) -> String {
    let err = cli::err_text(out);
    assert!(err.contains(says), "expected \"{says}\" in: {err}");
    err
}

#[test]
fn a_persons_files_are_never_overwritten() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    // Their notes.
    let notes = work.path().join("notes.md");
    std::fs::write(&notes, "my notes").unwrap();
    // A prefill of the documents onto `out`, under the limits.
    let (docs_dir, model) = (d.path().to_str().unwrap(), demo());
    let prefill_onto = |out: &Path| {
        limited(folio_cmd(&["prefill", "--model", &model, "--docs", docs_dir, "--out", out.to_str().unwrap()]))
    };
    let out = prefill_onto(&notes);
    refused(out, "is not a Folio context file: Folio never replaces another file");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");
    // A document the prefill reads.
    let own = d.path().join("field_notes.txt");
    let before = std::fs::read(&own).unwrap();
    let out = prefill_onto(&own);
    refused(out, "is one of the documents this prefill reads");
    assert_eq!(std::fs::read(&own).unwrap(), before);
    // Another context: replaced with a warning (and with --force, without).
    let other = work.path().join("other.folio");
    assert!(prefill(d.path(), &other, &[]).status.success());
    let again = prefill(d.path(), &other, &[]);
    assert!(again.status.success() && String::from_utf8_lossy(&again.stderr).contains("replacing the context file"));
    let forced = prefill(d.path(), &other, &["--force"]);
    assert!(forced.status.success() && !String::from_utf8_lossy(&forced.stderr).contains("replacing"));
}

#[test]
fn devices_and_named_pipes_are_refused_as_inputs() {
    let work = tempfile::tempdir().unwrap();
    let fifo = work.path().join("pipe");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for input in [Path::new("/dev/zero"), fifo.as_path()] {
        let i = input.to_str().unwrap();
        let what = if input == fifo { "is a named pipe" } else { "is a device" };
        refused(limited(folio_cmd(&["perplexity", "--model", &demo(), "--file", i])), what);
        refused(limited(folio_cmd(&["chat", "--model", &demo(), "--continue", i, "hello"])), what);
    }
}

/// A document with a line of 1.4 MiB (a text export on one line) is read whole, not refused;
/// one of 20 MiB that becomes a few hundred tokens is warned about in `prefill` itself, as in
/// `--dry-run`, before the prefill starts.
#[test]
fn long_lines_are_read_and_a_shrinking_document_is_warned_about() {
    let d = tempfile::tempdir().unwrap();
    let word = "x".repeat(1000);
    let one_line = vec![word.as_str(); 1500].join(" ");
    std::fs::write(d.path().join("one-line.txt"), &one_line).unwrap();
    std::fs::write(d.path().join("shrinks.txt"), format!("{}\n", "a".repeat(100_000)).repeat(200)).unwrap();
    let work = tempfile::tempdir().unwrap();
    let out = limited(folio_cmd(&[
        "prefill",
        "--model",
        &demo(),
        "--docs",
        d.path().to_str().unwrap(),
        "--out",
        work.path().join("c.folio").to_str().unwrap(),
        "--json",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["skipped"], serde_json::json!([]), "{report}");
    let spans = report["documents"].as_array().unwrap();
    let tokens = |name: &str| {
        let s = spans.iter().find(|s| s["path"].as_str().unwrap().ends_with(name)).unwrap();
        s["end"].as_u64().unwrap() - s["start"].as_u64().unwrap()
    };
    // The demo model's words are whole words: 1500 of them, read in pieces, and a few wrapper tokens.
    assert!((1500..1600).contains(&tokens("one-line.txt")), "{report}");
    assert!(tokens("shrinks.txt") < 400, "{report}");
    assert!(stderr.contains("shrinks.txt: 19.1 MiB of text became only"), "{stderr}");
}

/// A document whose name is not UTF-8 is kept by its exact bytes: removing another document
/// afterwards reads it again from its own name (the lossy name would not open).
#[test]
fn a_name_that_is_not_utf8_is_kept_as_the_os_gives_it() {
    use std::os::unix::ffi::OsStrExt;
    let d = docs(1);
    // Last in name order: a removal re-reads the documents after the removed one.
    let odd = d.path().join(std::ffi::OsStr::from_bytes(b"z-\xff\xfe-name.txt"));
    std::fs::write(&odd, "the secret code of amber falcon is 4 8 1 5 2 .").unwrap();
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("odd.folio");
    let made = prefill(d.path(), &ctx, &[]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let c = ctx.to_str().unwrap();
    let out = limited(folio_cmd(&["prefill", "--context", c, "--remove", "market_records.txt", "--json"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info = limited(folio_cmd(&["context", "info", c, "--json"]));
    let listed = String::from_utf8_lossy(&info.stdout);
    assert!(listed.contains("z-\u{10FFFF}\u{10FFFE}-name.txt") && !listed.contains("market_records"), "{listed}");
}

/// A model folder whose chat template is `template`.
fn model_with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(root().join("tests/fixtures/models/llama")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    dir
}

#[test]
fn hostile_chat_templates_fail_in_bounded_time_and_memory() {
    let loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}";
    let huge = "{% for i in range(10000) %}{% for j in range(10000) %}{{ 'x' * 4000 }}{% endfor %}{% endfor %}";
    for (template, says) in [(loops, "steps without finishing"), (huge, "wrote more than 64 MiB")] {
        let model = model_with_template(template);
        let started = Instant::now();
        let out =
            limited(folio_cmd(&["chat", "--model", model.path().to_str().unwrap(), "hello", "--max-tokens", "1"]));
        refused(out, says);
        assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    }
}

/// A template that doubles a string forty times (a terabyte in forty steps: minijinja counts a
/// concatenation as one step) stops the process at the allocator's bound for templates, with
/// the reason, before the memory limit here.
#[test]
fn a_template_that_doubles_a_string_stops_at_its_memory_bound() {
    let doubling = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}";
    let model = model_with_template(doubling);
    let started = Instant::now();
    let out = limited(folio_cmd(&["chat", "--model", model.path().to_str().unwrap(), "hello", "--max-tokens", "1"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("folio: stopped: the model's chat template took more than 1024 MiB of memory"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

#[test]
fn a_name_with_a_line_break_is_refused() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("named.folio");
    assert!(prefill(d.path(), &ctx, &[]).status.success());
    let out = limited(folio_cmd(&["library", "rename", ctx.to_str().unwrap(), "line\nbreak"]));
    refused(out, "control characters");
    assert!(ctx.exists() && !work.path().join("line\nbreak.folio").exists());
}

/// A context file with `edit` applied to its header JSON and sections, every checksum then
/// recomputed (what a crafted file looks like to `--verify`).
fn crafted(from: &Path, to: &Path, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>)) {
    let mut bytes = std::fs::read(from).unwrap();
    let header_len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[32..32 + header_len]).unwrap();
    edit(&mut header, &mut bytes);
    for s in header["sections"].as_array_mut().unwrap() {
        let (at, n) = (s["offset"].as_u64().unwrap() as usize, s["bytes"].as_u64().unwrap() as usize);
        s["xxh3"] = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes[at..at + n])).into();
    }
    let json = serde_json::to_vec(&header).unwrap();
    assert_eq!(json.len(), header_len, "the edit must keep the header's length");
    bytes[32..32 + header_len].copy_from_slice(&json);
    bytes[24..32].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&json).to_le_bytes());
    std::fs::write(to, bytes).unwrap();
}

fn section(header: &serde_json::Value, kind: &str) -> (usize, usize) {
    let s = header["sections"].as_array().unwrap().iter().find(|s| s["kind"] == kind).unwrap();
    (s["offset"].as_u64().unwrap() as usize, s["bytes"].as_u64().unwrap() as usize)
}

#[test]
fn checksum_consistent_lies_are_refused_and_import_leaves_nothing() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let good = work.path().join("good.folio");
    assert!(prefill(d.path(), &good, &["--no-library"]).status.success());
    // A token id outside the vocabulary.
    let bad_token = work.path().join("bad token.folio");
    crafted(&good, &bad_token, |h, bytes| {
        let (at, _) = section(h, "tokens");
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    });
    // A document span past the end of the tokens (same number of digits: the header keeps
    // its length).
    let bad_span = work.path().join("bad span.folio");
    crafted(&good, &bad_span, |h, bytes| {
        let (at, n) = section(h, "documents");
        let mut docs: serde_json::Value = serde_json::from_slice(&bytes[at..at + n]).unwrap();
        let last = docs.as_array_mut().unwrap().last_mut().unwrap();
        let end = last["end"].as_u64().unwrap();
        last["end"] = (end + 100).into();
        let json = serde_json::to_vec(&docs).unwrap();
        assert_eq!(json.len(), n);
        bytes[at..at + n].copy_from_slice(&json);
    });
    for (file, says) in [(&bad_token, "outside the model's vocabulary"), (&bad_span, "inside the")] {
        refused(limited(folio_cmd(&["context", "info", file.to_str().unwrap(), "--verify"])), says);
        refused(limited(folio_cmd(&["library", "import", file.to_str().unwrap()])), says);
    }
    let contexts = cli::test_home().join("contexts");
    let left: Vec<PathBuf> = std::fs::read_dir(&contexts).into_iter().flatten().flatten().map(|e| e.path()).collect();
    assert!(!left.iter().any(|p| p.to_string_lossy().contains("bad ")), "{left:?}");
}

/// A context file names its model; opening it never downloads one (the hub's address is a
/// closed port: a download would say so instead).
#[test]
fn a_context_file_never_makes_folio_reach_the_network() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let good = work.path().join("good.folio");
    assert!(prefill(d.path(), &good, &["--no-library"]).status.success());
    let evil = work.path().join("evil.folio");
    crafted(&good, &evil, |h, _| {
        // A repo id as long as the demo model's path: the header keeps its length.
        let source = h["model"]["source"].as_str().unwrap().len();
        h["model"]["source"] = format!("evil-org/{}", "m".repeat(source - "evil-org/".len())).into();
    });
    let hf = tempfile::tempdir().unwrap();
    let mut cmd = folio_cmd(&["chat", "--context", evil.to_str().unwrap(), "hello"]);
    cmd.env("HF_HOME", hf.path()).env("HF_ENDPOINT", "http://127.0.0.1:9").env_remove("HF_HUB_OFFLINE");
    refused(limited(cmd), "Folio downloads a model only when asked");
}
