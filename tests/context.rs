//! Context files end to end through the `folio` binary: prefill → info → chat → follow-ups,
//! every method over one saved file with its stored indexes, a dry run's counts, a context grown
//! in place, the samples' documented answers, mixed K/V dtypes, rich documents cited by page, and
//! a context read with other weights of its model.
//! Real files, real processes, no mocks. Interrupted, damaged and refused runs are in
//! context_recovery.rs.

use std::path::PathBuf;

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{demo, docs, err_text, folio, ok_json, prefill, root};

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

/// Every method on one reopened file with no new prefill, each recording its settings: at 100%
/// each answers exactly as dense, at 5% each gives its own answer (Double Sparsity through a
/// calibration made on a copy of the model); indexes stored in the file load back and answer as
/// the built ones, other settings build theirs, and a damaged index is rebuilt with a warning.
#[test]
fn every_method_and_stored_indexes_on_one_file() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("s.folio");
    ok_json(prefill(d.path(), &ctx, &[]));
    let question = "what is the secret code of amber falcon ?";
    let c = ctx.to_str().unwrap();
    let ask = |extra: &[&str]| {
        let mut args = vec!["chat", "--context", c, question, "--json", "--temperature", "0", "--max-tokens", "16"];
        args.extend_from_slice(extra);
        ok_json(folio(&args))
    };
    let answer = ask(&[]);
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

/// The log a person attaches to a problem report (docs/logs.md): a day's file in
/// `$FOLIO_HOME/logs/` with each step and its figures — the model loaded, the context written
/// (tokens, seconds, tokens/s), opened, the answer, a failed command with its error — and none
/// of the documents' or the question's text.
#[test]
fn the_log_records_each_step_with_figures_and_no_text() {
    let d = docs(1);
    let home = tempfile::tempdir().unwrap();
    let ctx = home.path().join("s.folio");
    let (docs_dir, c) = (d.path().to_str().unwrap(), ctx.to_str().unwrap());
    let run = |args: &[&str]| cli::folio_cmd(args).env("FOLIO_HOME", home.path()).output().unwrap();
    let demo = demo();
    assert!(run(&["prefill", "--model", &demo, "--docs", docs_dir, "--out", c]).status.success());
    let asked = run(&["chat", "--context", c, "what is the secret code of amber falcon ?", "--max-tokens", "4"]);
    assert!(asked.status.success(), "{}", String::from_utf8_lossy(&asked.stderr));
    // A failure is in the log too (and on stderr once, as before).
    let failed = run(&["chat", "--model", &demo, "--context", "/nowhere/x.folio", "hello"]);
    assert_eq!(String::from_utf8_lossy(&failed.stderr).matches("nowhere").count(), 1);
    let folder = home.path().join("logs");
    let mut log = String::new();
    for f in std::fs::read_dir(&folder).unwrap() {
        let path = f.unwrap().path();
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("folio."), "{}", path.display());
        log.push_str(&std::fs::read_to_string(path).unwrap());
    }
    for want in [
        "model loaded",
        "context written",
        "tokens_per_s=",
        "context opened",
        "answered",
        "answer_tokens=",
        "failed",
        "/nowhere/x.folio",
    ] {
        assert!(log.contains(want), "{want} missing from the log:\n{log}");
    }
    for text in ["falcon", "amber", "secret code"] {
        assert!(!log.contains(text), "the log holds text ({text}):\n{log}");
    }
}

/// A context read with other weights of its model (the demo model's projections quantized on
/// load): refused with both named and the flag that reads it; read with
/// `--accept-other-weights`, a warning on stderr and the answer still found; never changed by
/// them (an append is refused, flag or not); another model stays refused whatever the flag.
#[test]
fn other_weights_are_refused_or_read_on_request() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("plain.folio");
    ok_json(prefill(d.path(), &ctx, &[]));
    let c = ctx.display().to_string();
    let question = "what is the secret code of amber falcon ?";
    let err = err_text(folio(&["chat", "--context", &c, "--quantize", "q8_0", question]));
    assert!(err.contains("other weights of this model"), "{err}");
    assert!(err.contains("quantization null vs \"Q8_0 (quantized on load)\""), "{err}");
    assert!(err.contains("--accept-other-weights"), "{err}");
    let out = folio(&["chat", "--context", &c, "--quantize", "q8_0", "--accept-other-weights", question, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let answer = ok_json(out);
    assert!(stderr.contains("warning: this context was made with other weights"), "{stderr}");
    assert!(answer["text"].as_str().unwrap_or_default().contains("4 8 1 5 2"), "{answer}");
    let extra = work.path().join("extra.txt");
    std::fs::write(&extra, "the lucky number of jade tiger is 9 0 4 5 5 .").unwrap();
    let x = extra.display().to_string();
    for flag in [None, Some("--accept-other-weights")] {
        let mut args = vec!["prefill", "--context", &c, "--add", &x, "--quantize", "q8_0"];
        args.extend(flag);
        let err = err_text(folio(&args));
        assert!(err.contains("cannot be changed with these") && err.contains("--model"), "{flag:?}: {err}");
    }
    let llama = root().join("tests/fixtures/models/llama").display().to_string();
    let err = err_text(folio(&["chat", "--context", &c, "--model", &llama, "--accept-other-weights", question]));
    assert!(err.contains("was made with model demo"), "{err}");
}

/// `--prefill sparse:KNOBS` (knobs small enough to be sparse on the samples' ~700 tokens): the
/// report, `context info` and a chat's provenance name it; growing the context densely records
/// both runs; an unknown knob is refused by name.
#[test]
fn a_sparse_prefill_is_recorded_and_a_dense_addition_beside_it() {
    let d = docs(1);
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("sparse.folio");
    let (o, m) = (out.display().to_string(), demo());
    let (first, last) = (d.path().join("field_notes.txt"), d.path().join("the_diary_of_greta.txt"));
    let (f, l) = (first.display().to_string(), last.display().to_string());
    let mode = "sparse:block=16,keys=64,sinks=16,window=64";
    let report = ok_json(folio(&["prefill", "--model", &m, "--docs", &f, "--out", &o, "--prefill", mode, "--json"]));
    assert_eq!(report["report"]["prefill"].as_str(), Some(mode), "{report}");
    let saved = report["report"]["tokens"].as_u64().unwrap();
    assert!(saved > 160, "{saved} tokens: the first sparse block (10) starts at 160");
    let info = ok_json(folio(&["context", "info", &o, "--json"]));
    assert_eq!(info["prefill"], serde_json::json!([{ "from": 0, "to": saved, "mode": mode }]), "{info}");
    let answer = ok_json(folio(&["chat", "--context", &o, "what is the secret code of amber falcon ?", "--json"]));
    assert_eq!(answer["context"]["prefill"][0]["mode"].as_str(), Some(mode), "{answer}");

    ok_json(folio(&["prefill", "--context", &o, "--add", &l, "--json"]));
    let info = ok_json(folio(&["context", "info", &o, "--json"]));
    let runs = info["prefill"].as_array().unwrap();
    let modes: Vec<(u64, u64, &str)> = runs
        .iter()
        .map(|r| (r["from"].as_u64().unwrap(), r["to"].as_u64().unwrap(), r["mode"].as_str().unwrap()))
        .collect();
    assert_eq!(modes, [(0, saved, mode), (saved, info["tokens"].as_u64().unwrap(), "dense")], "{info}");

    let err = err_text(folio(&[
        "prefill",
        "--model",
        &m,
        "--docs",
        &f,
        "--out",
        &o,
        "--force",
        "--prefill",
        "sparse:depth=3",
    ]));
    assert!(err.contains("no knob `depth`") && err.contains("block, keys, sinks, window"), "{err}");
    let err = err_text(folio(&["prefill", "--model", &m, "--docs", &f, "--out", &o, "--force", "--prefill", "fast"]));
    assert!(err.contains("unknown prefill `fast`"), "{err}");
}
