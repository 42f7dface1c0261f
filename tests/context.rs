//! Context files end to end through the `folio` binary: prefill → info → chat → follow-ups,
//! kill -9 and resume (byte-identical), corruption of each section type, the wrong model, a
//! full disk, and an over-long collection. Real files, real processes, no mocks.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn demo() -> String {
    root().join("assets/models/demo").display().to_string()
}

/// The library these runs register contexts in (`folio prefill` lists what it makes): one per
/// test process, never the user's.
fn test_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("home-{}", std::process::id()))
}

fn folio_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_folio"));
    cmd.args(args).args(["--device", "cpu"]).env("FOLIO_HOME", test_home());
    cmd
}

fn folio(args: &[&str]) -> Output {
    folio_cmd(args).output().expect("run folio")
}

fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The error of a failed run: exit code 1 (an error), or 2 (a bad argument, refused by the
/// argument parser), not a panic's 101, and its message.
fn err_text(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(matches!(out.status.code(), Some(1 | 2)), "expected a clean error, got {:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// The sample documents (demo-model prose), `copies` times over, in a fresh folder, plus a
/// hidden file and a binary file that prefill must skip.
fn docs(copies: usize) -> tempfile::TempDir {
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

fn prefill(docs: &Path, out: &Path, extra: &[&str]) -> Output {
    let (d, o, m) = (docs.display().to_string(), out.display().to_string(), demo());
    let mut args = vec!["prefill", "--model", &m, "--docs", &d, "--out", &o, "--json"];
    args.extend_from_slice(extra);
    folio(&args)
}

/// Prefill, inspect, ask: the answer over the reopened context is the answer to the same
/// prompt asked in one go (same prompt tokens, same greedy tokens); follow-ups go to a
/// conversation file that refuses other contexts.
#[test]
fn prefill_info_chat_and_follow_ups() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("s.folio");
    let out = prefill(d.path(), &ctx, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = ok_json(out);
    assert!(stderr.contains(".notes.txt: hidden") && stderr.contains("photo.jpg: binary"), "{stderr}");
    assert_eq!(report["report"]["documents"], 3);
    let skipped: Vec<&str> =
        report["skipped"].as_array().unwrap().iter().map(|s| s["reason"].as_str().unwrap()).collect();
    assert_eq!(skipped.len(), 2, "{skipped:?}");

    let info = ok_json(folio(&["context", "info", ctx.to_str().unwrap(), "--verify", "--json"]));
    assert_eq!(info["documents"].as_array().unwrap().len(), 3);
    assert_eq!(info["model"]["name"], "demo");
    assert_eq!(info["verified"]["sections"], 2 + 2 * 4);
    let tokens = info["tokens"].as_u64().unwrap() as usize;
    let spans = info["documents"].as_array().unwrap();
    assert_eq!(spans.last().unwrap()["end"].as_u64().unwrap() as usize, tokens, "spans cover the documents");

    let question = "what is the secret code of amber falcon ?";
    let c = ctx.to_str().unwrap();
    let answer =
        ok_json(folio(&["chat", "--context", c, question, "--json", "--temperature", "0", "--max-tokens", "16"]));
    // The same conversation in one prompt: the documents inline in the user message.
    let mut inline = String::new();
    for name in ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"] {
        let text = std::fs::read_to_string(d.path().join(name)).unwrap();
        inline.push_str(&format!("<|doc|> title : {name} .\n{text}\n"));
    }
    inline.push_str(question);
    let plain =
        ok_json(folio(&["chat", "--model", &demo(), &inline, "--json", "--temperature", "0", "--max-tokens", "16"]));
    // The saved tokens, read from the file's tokens section, then the question's tail.
    let sections = info["sections"].as_array().unwrap();
    let t = sections.iter().find(|s| s["kind"] == "tokens").unwrap();
    let bytes = std::fs::read(&ctx).unwrap();
    let at = t["offset"].as_u64().unwrap() as usize;
    let mut ctx_prompt: Vec<u64> =
        bytes[at..at + 4 * tokens].chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64).collect();
    ctx_prompt.extend(answer["tail_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()));
    let plain_prompt: Vec<u64> =
        plain["prompt_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(plain_prompt, ctx_prompt, "prompt tokens: saved context + question vs the one-go prompt");
    assert_eq!(answer["tokens"], plain["tokens"], "greedy answers: {} vs {}", answer["text"], plain["text"]);

    // Other attention methods on the same file, no new prefill; each records its settings.
    let ask = |extra: &[&str]| {
        let mut args = vec!["chat", "--context", c, question, "--json", "--temperature", "0", "--max-tokens", "16"];
        args.extend_from_slice(extra);
        ok_json(folio(&args))
    };
    let full = ask(&["--method", "topk:100%:window=0"]);
    assert_eq!(full["tokens"], answer["tokens"], "top-k over every key answers as dense does");
    assert_eq!(full["attention"]["method"], "topk");
    assert_eq!(full["attention"]["params"]["window"], 0.0);
    let streaming = ask(&["--method", "streaming:64"]);
    assert_eq!(streaming["attention"]["budget"]["tokens"], 64);
    assert!(!streaming["tokens"].as_array().unwrap().is_empty());
    // Every other method on the same reopened file (Double Sparsity through a calibration made
    // on a copy of the model): at 100% each answers exactly as dense; at 5% each gives its own
    // answer with its settings recorded; the context file is never rewritten.
    let model_copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(demo()).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), model_copy.path().join(e.file_name())).unwrap();
    }
    let mc = model_copy.path().to_str().unwrap();
    let cal = ok_json(folio(&["calibrate", "--model", mc, "--docs", d.path().to_str().unwrap(), "--json"]));
    assert!(cal["tokens"].as_u64().unwrap() > 100, "{cal}");
    assert!(model_copy.path().join("folio-channels.json").exists());
    let stamp = std::fs::metadata(&ctx).unwrap().modified().unwrap();
    for m in ["topk-ivf", "magicpig", "hip", "double-sparsity", "buzz"] {
        let full = ask(&["--model", mc, "--method", &format!("{m}:100%")]);
        assert_eq!(full["tokens"], answer["tokens"], "{m} at 100% answers as dense does");
        let small = ask(&["--model", mc, "--method", &format!("{m}:5%")]);
        assert_eq!(small["attention"]["method"], m);
        assert_eq!(small["attention"]["budget"]["fraction"], 0.05);
        assert!(!small["tokens"].as_array().unwrap().is_empty(), "{m}: {small}");
    }
    assert_eq!(std::fs::metadata(&ctx).unwrap().modified().unwrap(), stamp, "no new prefill");

    // Indexes stored in the file: a chat with the same settings loads them (and answers as
    // with the built ones); other settings still build theirs; a damaged index is named.
    let indexed = work.path().join("indexed.folio");
    std::fs::copy(&ctx, &indexed).unwrap();
    let ix = indexed.to_str().unwrap();
    let ask_on = |file: &str, extra: &[&str]| {
        let mut args = vec!["chat", "--context", file, question, "--json", "--temperature", "0", "--max-tokens", "16"];
        args.extend_from_slice(extra);
        ok_json(folio(&args))
    };
    for m in ["magicpig", "double-sparsity", "topk-ivf"] {
        let method = format!("{m}:5%");
        let settings = ["--model", mc, "--method", &method];
        let built = ask_on(c, &settings);
        assert!(built["index"].as_object().unwrap().values().all(|s| s == "built"), "{m}: {}", built["index"]);
        let report = ok_json(folio(&[&["context", "index", ix][..], &settings, &["--json"]].concat()));
        assert!(report["sections"].as_u64().unwrap() >= 1, "{report}");
        let loaded = ask_on(ix, &settings);
        let sources = loaded["index"].as_object().unwrap();
        assert!(!sources.is_empty() && sources.values().all(|s| s == "file"), "{m}: {}", loaded["index"]);
        assert_eq!(loaded["tokens"], built["tokens"], "{m}: stored index answers as the built one");
    }
    let other = ask_on(ix, &["--method", "magicpig:10%"]);
    assert!(other["index"].as_object().unwrap().values().all(|s| s == "built"), "{}", other["index"]);
    let info = ok_json(folio(&["context", "info", ix, "--verify", "--json"]));
    let sections = info["sections"].as_array().unwrap();
    let pig =
        sections.iter().find(|s| s["kind"] == "index" && s["name"].as_str().unwrap().starts_with("magicpig")).unwrap();
    let mut bytes = std::fs::read(&indexed).unwrap();
    bytes[pig["offset"].as_u64().unwrap() as usize + 100] ^= 0xff;
    std::fs::write(&indexed, bytes).unwrap();
    // A damaged stored index is only a lost cache: rebuilt for the answer, with a warning.
    let out = folio(&["chat", "--context", ix, question, "--method", "magicpig:5%", "--json"]);
    let warning = String::from_utf8_lossy(&out.stderr).into_owned();
    let rebuilt = ok_json(out);
    assert!(warning.contains("damaged") && warning.contains("folio context index"), "{warning}");
    assert!(rebuilt["index"].as_object().unwrap().values().any(|s| s == "rebuilt"), "{}", rebuilt["index"]);
    let err = err_text(folio(&["context", "info", ix, "--verify"]));
    assert!(err.contains("index magicpig") && err.contains("of layer") && err.contains("corrupted"), "{err}");
    assert!(err_text(folio(&["context", "index", c, "--method", "topk:5%"])).contains("keeps no index"));
    let err = err_text(folio(&["chat", "--context", c, question, "--method", "double-sparsity"]));
    assert!(err.contains("folio calibrate"), "{err}");
    let err = err_text(folio(&["chat", "--context", c, question, "--method", "topk:5%:k=3"]));
    assert!(err.contains("unknown parameter \"k\"") && err.contains("window"), "{err}");

    // Follow-ups in a conversation file.
    let conv = work.path().join("chat.json");
    let cv = conv.to_str().unwrap();
    let t1 = ok_json(folio(&["chat", "--context", c, "--continue", cv, question, "--json", "--max-tokens", "8"]));
    let t2 = ok_json(folio(&[
        "chat",
        "--context",
        c,
        "--continue",
        cv,
        "and of cobalt heron ?",
        "--json",
        "--max-tokens",
        "8",
    ]));
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&conv).unwrap()).unwrap();
    let roles: Vec<&str> = saved["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert!(t2["tail_tokens"].as_array().unwrap().len() > t1["tail_tokens"].as_array().unwrap().len());
    // The same conversation file on another context is refused.
    let other = work.path().join("other.folio");
    ok_json(prefill(&d.path().join("field_notes.txt"), &other, &[]));
    let err = err_text(folio(&["chat", "--context", other.to_str().unwrap(), "--continue", cv, "hi"]));
    assert!(err.contains("continues the conversation over"), "{err}");
}

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

/// `folio prefill --dry-run` (the staging sheet in the terminal) counts what the prefill then
/// computes, lists the skips, writes nothing; over the model's length it is refused.
#[test]
fn dry_run_counts_what_the_prefill_computes() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("c.folio");
    let staged = ok_json(prefill(d.path(), &out, &["--dry-run"]));
    assert!(!out.exists() && !PathBuf::from(format!("{}.partial", out.display())).exists());
    let skipped: Vec<&str> =
        staged["staged"]["skipped"].as_array().unwrap().iter().map(|s| s["reason"].as_str().unwrap()).collect();
    assert!(skipped.contains(&"hidden") && skipped.iter().any(|r| r.starts_with("binary")), "{skipped:?}");
    let report = ok_json(prefill(d.path(), &out, &[]));
    assert_eq!(staged["tokens"], report["report"]["tokens"]);
    assert_eq!(staged["estimate"]["file_bytes"], report["report"]["file_bytes"]);
    let counts: Vec<u64> =
        staged["staged"]["documents"].as_array().unwrap().iter().map(|x| x["tokens"].as_u64().unwrap()).collect();
    let spans: Vec<u64> = report["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["end"].as_u64().unwrap() - x["start"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, spans);
    let llama = root().join("tests/fixtures/models/llama").display().to_string();
    let (dp, op) = (d.path().display().to_string(), out.display().to_string());
    let err = err_text(folio(&["prefill", "--model", &llama, "--docs", &dp, "--out", &op, "--dry-run"]));
    assert!(err.contains("over what the model reads") && err.contains("never truncates"), "{err}");
}

/// `folio prefill --context F --add DOC` grows a saved context in place: the same tokens and
/// file as a prefill of every document in one go (f32 K/V), the library lists it grown, and
/// the grown context answers; `--remove DOC` takes one out, the same as a prefill without it.
#[test]
fn prefill_add_grows_a_context_in_place() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let (whole, grown) = (work.path().join("whole.folio"), work.path().join("grown.folio"));
    let f32 = ["--kv-dtype", "f32"];
    ok_json(prefill(d.path(), &whole, &f32));
    let (first, rest) = (d.path().join("field_notes.txt"), d.path().join("market_records.txt"));
    let last = d.path().join("the_diary_of_greta.txt");
    let (g, m) = (grown.display().to_string(), demo());
    let (f, r, l) = (first.display().to_string(), rest.display().to_string(), last.display().to_string());
    ok_json(folio(&["prefill", "--model", &m, "--docs", &f, &r, "--out", &g, "--kv-dtype", "f32", "--json"]));
    let before = ok_json(folio(&["library", "show", &g, "--json"]));
    let report = ok_json(folio(&["prefill", "--context", &g, "--add", &l, "--json"]));
    let added = report["documents"].as_array().unwrap().last().unwrap().clone();
    let span = added["end"].as_u64().unwrap() - added["start"].as_u64().unwrap();
    assert_eq!(report["report"]["computed_tokens"].as_u64(), Some(span), "only the new document is computed");
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&grown).unwrap(), "grown != prefilled in one go");
    let after = ok_json(folio(&["library", "show", &g, "--json"]));
    assert_eq!(after["context"]["id"], before["context"]["id"]);
    assert_eq!((after["context"]["documents"].as_u64(), after["documents"].as_array().unwrap().len()), (Some(3), 3));
    let answer = ok_json(folio(&["chat", "--context", &g, "what is the secret code of amber falcon ?", "--json"]));
    assert!(answer["text"].as_str().unwrap_or_default().contains("4 8 1 5 2"), "{answer}");
    // Adding what is there, or growing with another K/V dtype, is refused.
    let err = err_text(folio(&["prefill", "--context", &g, "--add", &l]));
    assert!(err.contains("already in this context"), "{err}");
    let extra = work.path().join("extra.txt");
    std::fs::write(&extra, "the lucky number of jade tiger is 9 0 4 5 5 .").unwrap();
    let x = extra.display().to_string();
    let err = err_text(folio(&["prefill", "--context", &g, "--add", &x, "--kv-dtype", "bf16"]));
    assert!(err.contains("--kv-dtype f32"), "{err}");

    // Taking the middle document out re-prefills the one after it: the file is the one
    // prefilled without it in one go; the last one out re-prefills the one before it.
    let without = work.path().join("without.folio");
    let wo = without.display().to_string();
    ok_json(folio(&["prefill", "--model", &m, "--docs", &f, &l, "--out", &wo, "--kv-dtype", "f32", "--json"]));
    let cut = ok_json(folio(&["prefill", "--context", &g, "--remove", "market_records.txt", "--json"]));
    let last = cut["documents"].as_array().unwrap().last().unwrap().clone();
    let again = last["end"].as_u64().unwrap() - last["start"].as_u64().unwrap();
    assert_eq!(cut["report"]["computed_tokens"].as_u64(), Some(again), "only the documents after it are computed");
    assert!(std::fs::read(&without).unwrap() == std::fs::read(&grown).unwrap(), "removed != prefilled without");
    let only = work.path().join("only.folio");
    let on = only.display().to_string();
    ok_json(folio(&["prefill", "--model", &m, "--docs", &f, "--out", &on, "--kv-dtype", "f32", "--json"]));
    ok_json(folio(&["prefill", "--context", &g, "--remove", &l, "--json"]));
    assert!(std::fs::read(&only).unwrap() == std::fs::read(&grown).unwrap(), "last removed != prefilled without");
    let err = err_text(folio(&["prefill", "--context", &g, "--remove", &f]));
    assert!(err.contains("only document") && err.contains("delete the context"), "{err}");
    let err = err_text(folio(&["prefill", "--context", &g, "--remove", "nothing.txt"]));
    assert!(err.contains("no document \"nothing.txt\"") && err.contains("field_notes.txt"), "{err}");
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
    std::fs::write(&out, b"the previous context").unwrap();
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
    let err = err_text(cmd.output().unwrap());
    assert!(err.contains("not enough disk space") && err.contains("Nothing was kept"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"the previous context");
    let names: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["c.folio"], "nothing else is left");
    // The library lists nothing that is not there.
    assert!(err_text(folio(&["library", "show", &op])).contains("no context"));
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

/// assets/SAMPLES.md's table is what a new user tries first (the README's commands): every
/// question gets its documented answer, word for word, from one context file of the whole sample
/// folder.
#[test]
fn sample_questions_get_the_documented_answers() {
    let table = std::fs::read_to_string(root().join("assets/SAMPLES.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let all = dir.path().join("all.folio");
    ok_json(prefill(&root().join("assets/samples"), &all, &[]));
    let all = all.display().to_string();
    let mut asked = 0;
    for row in table.lines().filter(|l| l.starts_with("| what")) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let [question, expected, _file] = cells[..] else { panic!("SAMPLES.md row with {} cells: {row}", cells.len()) };
        let answer = ok_json(folio(&[
            "chat",
            "--context",
            &all,
            question,
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
        ]));
        assert_eq!(answer["text"].as_str().unwrap().trim(), expected, "{question}");
        asked += 1;
    }
    assert_eq!(asked, 9, "SAMPLES.md's table has nine questions");
}

/// `--kv-dtype bf16-fp8` (bf16 keys, fp8 values) end to end: the file says so, sizes its K
/// sections as bf16 and its V sections as fp8, verifies, and answers a sample question as
/// documented, resident and offloaded.
#[test]
fn mixed_kv_dtype_prefills_verifies_and_answers() {
    let dir = tempfile::tempdir().unwrap();
    let mixed = dir.path().join("mixed.folio");
    ok_json(prefill(&root().join("assets/samples"), &mixed, &["--kv-dtype", "bf16-fp8"]));
    let info = ok_json(folio(&["context", "info", mixed.to_str().unwrap(), "--verify", "--json"]));
    assert_eq!(info["kv_dtype"], "bf16-fp8", "{info}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("assets/models/demo/config.json")).unwrap()).unwrap();
    let rows = config["num_key_value_heads"].as_u64().unwrap() * info["tokens"].as_u64().unwrap();
    let d = config["head_dim"].as_u64().unwrap();
    let bytes_of = |kind: &str| -> Vec<u64> {
        let sections = info["sections"].as_array().unwrap();
        sections.iter().filter(|s| s["kind"] == kind).map(|s| s["bytes"].as_u64().unwrap()).collect()
    };
    let fp8 = (rows * d).next_multiple_of(8) + rows * 4;
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    assert_eq!((bytes_of("keys").len(), bytes_of("values").len()), (layers, layers));
    assert!(bytes_of("keys").iter().all(|&b| b == rows * d * 2), "{:?}", bytes_of("keys"));
    assert!(bytes_of("values").iter().all(|&b| b == fp8), "{:?}", bytes_of("values"));
    let question = "what is the secret code of amber falcon ?";
    for extra in [&[][..], &["--offload"][..]] {
        let mut args = vec![
            "chat",
            "--context",
            mixed.to_str().unwrap(),
            question,
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "16",
        ];
        args.extend_from_slice(extra);
        let answer = ok_json(folio(&args));
        assert_eq!(
            answer["text"].as_str().unwrap().trim(),
            "the secret code of amber falcon is 4 8 1 5 2 .",
            "{extra:?}"
        );
    }
}

/// The demo model's samples as real PDF, DOCX and EPUB files (tests/ingest, made by LibreOffice
/// and pandoc): a context of them answers SAMPLES.md's questions as the .txt files do, and the
/// sources of an answer name the page or chapter the fact is on ("field_notes.pdf, p. 2").
#[test]
fn rich_documents_answer_and_cite_their_page() {
    let good = root().join("tests/ingest/good");
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("docs");
    std::fs::create_dir(&docs).unwrap();
    for name in ["field_notes.pdf", "market_records.docx", "the_diary_of_greta.epub"] {
        std::fs::copy(good.join(name), docs.join(name)).unwrap();
    }
    let ctx = dir.path().join("rich.folio");
    let report = ok_json(prefill(&docs, &ctx, &[]));
    assert_eq!(report["report"]["documents"], 3, "{report}");
    let info = ok_json(folio(&["context", "info", ctx.to_str().unwrap(), "--json"]));
    let pdf = info["documents"].as_array().unwrap().iter().find(|d| d["title"] == "field_notes.pdf").unwrap().clone();
    let labels: Vec<&str> = pdf["parts"].as_array().unwrap().iter().map(|p| p["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["p. 1", "p. 2"], "{pdf}");
    for (question, expected, source, part) in [
        (
            "what is the secret code of amber falcon ?",
            "the secret code of amber falcon is 4 8 1 5 2 .",
            "field_notes.pdf",
            "p. 2",
        ),
        (
            "what is the access code of cobalt heron ?",
            "the access code of cobalt heron is 6 6 1 2 0 .",
            "market_records.docx",
            "Market Report",
        ),
        ("what is the pass key ?", "the pass key is 9 0 4 1 7 .", "the_diary_of_greta.epub", "Monday"),
    ] {
        let answer = ok_json(folio(&[
            "chat",
            "--context",
            ctx.to_str().unwrap(),
            question,
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
            "--sources",
        ]));
        assert_eq!(answer["text"].as_str().unwrap().trim(), expected, "{question}");
        let top = &answer["sources"][0];
        assert_eq!(top["title"], source, "{question}: {}", answer["sources"]);
        assert_eq!(top["passages"][0]["part"], part, "{question}: {top}");
    }
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
