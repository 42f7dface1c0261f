//! The `folio` binary end to end on the committed fixtures: what scripts see (`--json`), and
//! a clear, specific error for each kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models").join(name)
}

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap()
}

/// The library these runs register contexts in (`folio prefill` lists what it makes): one per
/// test process, never the user's.
fn test_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("home-{}", std::process::id()))
}

fn folio(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_folio"));
    cmd.args(args).env_remove("HF_HUB_OFFLINE").env("FOLIO_HOME", test_home());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run folio")
}

fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn err_text(out: Output) -> String {
    assert!(!out.status.success(), "folio should have failed: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A writable copy of a fixture, for breaking it.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn perplexity_json_matches_transformers() {
    for name in ["llama", "qwen2", "qwen3", "mistral"] {
        let r = reference(name);
        let file = fixture(name).join("ppl.txt");
        let model = fixture(name);
        let got = ok_json(folio(
            &["perplexity", "--model", model.to_str().unwrap(), "--file", file.to_str().unwrap(), "--json"],
            &[],
        ));
        let want = r["perplexity"]["perplexity"].as_f64().unwrap();
        let rel = (got["perplexity"].as_f64().unwrap() - want).abs() / want;
        println!("{name}: folio perplexity {} vs transformers {want} (rel {rel:.2e})", got["perplexity"]);
        assert!(rel < 1e-3, "{name}: relative difference {rel}");
        assert_eq!(got["tokens"].as_u64().unwrap() as usize, r["perplexity"]["input_ids"].as_array().unwrap().len());

        let cut = ok_json(folio(
            &[
                "perplexity",
                "--model",
                model.to_str().unwrap(),
                "--file",
                file.to_str().unwrap(),
                "--max-tokens",
                "40",
                "--json",
            ],
            &[],
        ));
        let want = r["perplexity_max_tokens"]["perplexity"].as_f64().unwrap();
        assert!((cut["perplexity"].as_f64().unwrap() - want).abs() / want < 1e-3, "{name}: --max-tokens 40");
        assert_eq!(cut["tokens"], 40);
    }
}

#[test]
fn greedy_chat_json_matches_transformers() {
    for name in ["llama", "qwen2", "qwen3", "mistral"] {
        let r = reference(name);
        let model = fixture(name);
        let messages = r["chat"]["messages"].as_array().unwrap();
        let out = ok_json(folio(
            &[
                "chat",
                "--model",
                model.to_str().unwrap(),
                "--json",
                "--temperature",
                "0",
                "--max-tokens",
                "16",
                "--system",
                messages[0]["content"].as_str().unwrap(),
                messages[1]["content"].as_str().unwrap(),
            ],
            &[],
        ));
        assert_eq!(ids(&out["prompt_tokens"]), ids(&r["greedy"]["prompt_ids"]), "{name}: prompt tokens");
        assert_eq!(ids(&out["tokens"]), ids(&r["greedy"]["new_tokens"]), "{name}: greedy tokens");
        assert_eq!(out["stop_reason"], "max_tokens");
        assert!(out["text"].is_string());
    }
}

#[test]
fn raw_text_is_tokenized_with_the_bos_rule() {
    // reference.json's perplexity ids are transformers' tokenization of ppl.txt with the BOS
    // rule applied (llama: added by its post-processor; qwen2, mistral: prepended from
    // config.json; qwen3: none), so `--raw` must reproduce them exactly.
    for name in ["llama", "qwen2", "qwen3", "mistral"] {
        let text = std::fs::read_to_string(fixture(name).join("ppl.txt")).unwrap();
        let out = ok_json(folio(
            &["chat", "--model", fixture(name).to_str().unwrap(), "--raw", &text, "--json", "--max-tokens", "1"],
            &[],
        ));
        assert_eq!(ids(&out["prompt_tokens"]), ids(&reference(name)["perplexity"]["input_ids"]), "{name}");
    }
}

#[test]
fn streamed_text_equals_the_final_answer() {
    let model = fixture("llama");
    let base = ["chat", "--model", model.to_str().unwrap(), "--temperature", "0", "--max-tokens", "16"];
    let json = ok_json(folio(&[&base[..], &["--json", "What is the capital of France?"]].concat(), &[]));
    let text = json["text"].as_str().unwrap();
    let streamed = folio(&[&base[..], &["What is the capital of France?"]].concat(), &[]);
    assert!(streamed.status.success());
    assert_eq!(String::from_utf8_lossy(&streamed.stdout), format!("{text}\n"));
    // With a stop string from the middle, the stream ends exactly where the answer does.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let streamed = folio(&[&base[..], &["--stop", &stop, "What is the capital of France?"]].concat(), &[]);
    assert_eq!(String::from_utf8_lossy(&streamed.stdout), format!("{}\n", &text[..text.find(&stop).unwrap()]));
}

#[test]
fn info_reports_the_model() {
    let out = ok_json(folio(&["info", "--model", fixture("qwen3").to_str().unwrap(), "--json"], &[]));
    assert_eq!(out["architecture"], "qwen3");
    assert_eq!(out["head_dim"], 32);
    assert_eq!(out["kv_heads"], 2);
    assert_eq!(out["max_context"], 512);
    // 2 (K and V) x 2 layers x 2 KV heads x 32 dims x 2 bytes (bf16).
    assert_eq!(out["kv_bytes_per_token"], 2 * 2 * 2 * 32 * 2);
    assert_eq!(out["device"], "cpu");
    let n = out["parameters"].as_u64().unwrap();
    assert!(n > 100_000 && n < 1_000_000, "{n}");
}

#[test]
fn missing_files_are_named() {
    for file in ["config.json", "tokenizer.json"] {
        let dir = copy_fixture("llama");
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let err = err_text(folio(&["info", "--model", dir.path().to_str().unwrap()], &[]));
        assert!(err.contains(&format!("{file} not found in")), "{err}");
    }
    let dir = copy_fixture("qwen3");
    std::fs::remove_file(dir.path().join("model-00003-of-00005.safetensors")).unwrap();
    let err = err_text(folio(&["info", "--model", dir.path().to_str().unwrap()], &[]));
    assert!(err.contains("model-00003-of-00005.safetensors not found"), "{err}");
}

#[test]
fn unknown_model_type_lists_the_supported_ones() {
    let dir = copy_fixture("llama");
    let cfg_path = dir.path().join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap().replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(&cfg_path, cfg).unwrap();
    let err = err_text(folio(&["info", "--model", dir.path().to_str().unwrap()], &[]));
    assert!(
        err.contains("unsupported model_type \"gpt_neox\"") && err.contains("llama, mistral, qwen2, qwen3"),
        "{err}"
    );
}

#[test]
fn truncated_weights_are_reported_with_sizes() {
    let dir = copy_fixture("llama");
    let weights = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(len / 2).unwrap();
    let err = err_text(folio(&["info", "--model", dir.path().to_str().unwrap()], &[]));
    assert!(
        err.contains("is truncated") && err.contains(&format!("has {}", len / 2)) && err.contains(&len.to_string()),
        "{err}"
    );
}

#[test]
fn over_long_prompts_are_refused_not_truncated() {
    let long = "the old captain carried a basket of apples to the market ".repeat(80);
    let model = fixture("llama");
    let err = err_text(folio(&["chat", "--model", model.to_str().unwrap(), "--raw", &long, "--max-tokens", "1"], &[]));
    assert!(
        err.contains("longer than the model's context length of 512 tokens") && err.contains("nothing was truncated"),
        "{err}"
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &long).unwrap();
    let err = err_text(folio(
        &["perplexity", "--model", model.to_str().unwrap(), "--file", file.path().to_str().unwrap()],
        &[],
    ));
    assert!(err.contains("context length of 512"), "{err}");
}

#[test]
fn hub_repo_ids_use_the_cache_and_fail_clearly_offline() {
    let home = tempfile::tempdir().unwrap();
    let offline: &[(&str, &Path)] = &[("HF_HOME", home.path()), ("HF_HUB_OFFLINE", Path::new("1"))];
    for value in ["1", "true", "ON"] {
        let env: &[(&str, &Path)] = &[("HF_HOME", home.path()), ("HF_HUB_OFFLINE", Path::new(value))];
        let err = err_text(folio(&["info", "--model", "folio-test/not-cached"], env));
        assert!(
            err.contains("model folio-test/not-cached is not in the Hugging Face cache")
                && err.contains("config.json is missing")
                && err.contains("HF_HUB_OFFLINE"),
            "HF_HUB_OFFLINE={value}: {err}"
        );
    }
    // Online, with a hub that does not answer (a closed port on this machine): a download error
    // that names the file, not a hang and not a panic.
    let unreachable: &[(&str, &Path)] = &[("HF_HOME", home.path()), ("HF_ENDPOINT", Path::new("http://127.0.0.1:9"))];
    let err = err_text(folio(&["info", "--model", "folio-test/not-cached"], unreachable));
    assert!(
        err.contains("downloading folio-test/not-cached/(file list) from the Hugging Face hub failed")
            && err.contains("the hub at http://127.0.0.1:9 cannot be reached"),
        "{err}"
    );

    // A cached repo (the hub's cache layout) loads with downloads forbidden.
    let repo = home.path().join("hub/models--folio-test--tiny-llama");
    let snapshot = repo.join("snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    for entry in std::fs::read_dir(fixture("llama")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, snapshot.join(p.file_name().unwrap())).unwrap();
    }
    let out = ok_json(folio(&["info", "--model", "folio-test/tiny-llama", "--json"], offline));
    assert_eq!(out["architecture"], "llama");
    assert_eq!(out["model"], "folio-test/tiny-llama");
}

#[test]
fn bad_arguments_are_explained() {
    let err = err_text(folio(&["info"], &[]));
    assert!(err.contains("--model is required"), "{err}");
    let err = err_text(folio(&["info", "--model", "no/such/place"], &[]));
    assert!(err.contains("neither a model folder nor a Hugging Face repo id"), "{err}");
    let model = fixture("llama");
    let err = err_text(folio(&["chat", "--model", model.to_str().unwrap(), "--temperature=-1", "hi"], &[]));
    assert!(err.contains("temperature must be >= 0"), "{err}");
    let err = err_text(folio(&["info", "--model", model.to_str().unwrap(), "--device", "tpu"], &[]));
    assert!(err.contains("bad device \"tpu\""), "{err}");
}

fn chat_json(model: &str, extra: &[&str]) -> Value {
    let dir = fixture(model);
    let mut args = vec!["chat", "--model", dir.to_str().unwrap(), "--json", "--max-tokens", "16"];
    args.extend_from_slice(extra);
    args.push("What is the capital of France?");
    ok_json(folio(&args, &[]))
}

#[test]
fn sampling_is_seeded_and_configurable() {
    let a = chat_json("qwen2", &["--temperature", "1.0", "--top-p", "0.95", "--top-k", "50", "--seed", "7"]);
    let b = chat_json("qwen2", &["--temperature", "1.0", "--top-p", "0.95", "--top-k", "50", "--seed", "7"]);
    assert_eq!(a["tokens"], b["tokens"], "same seed, same answer");
    assert_eq!(a["sampling"]["top_k"], 50);
    let others: Vec<Value> = (8..12)
        .map(|s| chat_json("qwen2", &["--temperature", "1.0", "--seed", &s.to_string()])["tokens"].clone())
        .collect();
    assert!(others.iter().any(|t| *t != a["tokens"]), "different seeds never changed the sample");
    // qwen3's greedy answer repeats tokens (443, 49, 86 in reference.json); a strong penalty
    // must make every generated token new.
    let system = ["--system", "You are a helpful assistant."];
    let greedy = ids(&chat_json("qwen3", &[&system[..], &["--temperature", "0"]].concat())["tokens"]);
    let distinct = |t: &[u64]| t.iter().collect::<std::collections::HashSet<_>>().len();
    assert!(distinct(&greedy) < greedy.len(), "the fixture's greedy answer no longer repeats: {greedy:?}");
    let penalised =
        ids(&chat_json("qwen3", &[&system[..], &["--temperature", "0", "--repetition-penalty", "100"]].concat())
            ["tokens"]);
    assert_eq!(distinct(&penalised), penalised.len(), "repetition penalty 100 still repeated: {penalised:?}");
}

#[test]
fn stop_strings_end_the_answer_and_are_not_shown() {
    let full = chat_json("llama", &["--temperature", "0"]);
    let text = full["text"].as_str().unwrap();
    // A stop string from the middle of the greedy answer: the answer must end right before it.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "greedy answer too short to test stop strings: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = chat_json("llama", &["--temperature", "0", "--stop", &stop]);
    assert_eq!(cut["stop_reason"], "stop_string");
    assert_eq!(cut["text"].as_str().unwrap(), &text[..text.find(&stop).unwrap()]);
}

/// `folio eval fidelity` on the demo model at 768 tokens: dense and streaming on a chain and a
/// pair prompt, both question modes: the table, the JSON's summaries and outcomes, the chart,
/// and the missed prompts.
#[test]
fn fidelity_eval_reports_each_method_against_dense() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let out = tempfile::tempdir().unwrap();
    let run = folio(
        &[
            "eval",
            "fidelity",
            "--model",
            demo.to_str().unwrap(),
            "--lengths",
            "768",
            "--tasks",
            "chain,pair",
            "--depths",
            "0.25",
            "--samples",
            "1",
            "--methods",
            "streaming",
            "--budgets",
            "32,25%",
            "--question",
            "both",
            "--out",
            out.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(log.contains("warming up on a "), "a warm-up before the timed prompts: {log}");
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("768 tokens, dense question:") && table.contains("768 tokens, sparse question:"), "{table}");
    assert!(table.contains("streaming:32") && table.contains("streaming:25%"), "{table}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("fidelity.json")).unwrap()).unwrap();
    assert_eq!(doc["complete"], true);
    let summaries = doc["summaries"].as_array().unwrap();
    assert_eq!(summaries.len(), 2 * 3, "dense and two budgets, each question mode");
    let dense = &summaries[0];
    assert_eq!((dense["method"].as_str(), dense["question"].as_str()), (Some("dense"), Some("dense")));
    assert_eq!(dense["mean_kl"], 0.0);
    assert_eq!(dense["overall"], 1.0, "the demo model answers both prompts");
    let narrow = &summaries[1];
    assert_eq!(narrow["method"], "streaming:32");
    assert!(narrow["overall"].as_f64().unwrap() < 1.0 && narrow["mean_kl"].as_f64().unwrap() > 0.1, "{narrow}");
    assert!(narrow["rows_read_fraction"].as_f64().unwrap() < 0.1, "{narrow}");
    let outcomes = doc["runs"][1]["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 2 * 2, "two prompts (not the warm-up), two question modes");
    let svg = std::fs::read_to_string(out.path().join("fidelity.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("exact answers") && svg.contains("dashed"), "the chart");
    // Every miss keeps its prompt: streaming:32 missed the chain with a dense question.
    let miss = out.path().join("misses/streaming-32");
    let sample: Value =
        serde_json::from_str(&std::fs::read_to_string(miss.join("chain-768-0.25-0-dense.json")).unwrap()).unwrap();
    let ids = std::fs::read(miss.join("chain-768-0.25-0-dense.u32")).unwrap();
    assert_eq!(ids.len(), 4 * sample["prompt_tokens"].as_u64().unwrap() as usize);

    // --replot draws the report again (with others, one chart across their lengths).
    let again = tempfile::tempdir().unwrap();
    let report = out.path().join("fidelity.json");
    let run = folio(
        &["eval", "fidelity", "--replot", report.to_str().unwrap(), "--out", again.path().to_str().unwrap()],
        &[],
    );
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let replotted = std::fs::read_to_string(again.path().join("fidelity.svg")).unwrap();
    assert!(replotted.contains("768 tokens: exact answers") && replotted.contains("streaming"), "the replotted chart");

    let err = err_text(folio(&["eval", "fidelity", "--model", demo.to_str().unwrap(), "--tasks", "essay"], &[]));
    assert!(err.contains("unknown task \"essay\": the tasks are needle, chain, pair"), "{err}");
    let err = err_text(folio(&["eval", "fidelity", "--model", demo.to_str().unwrap(), "--methods", "dense"], &[]));
    assert!(err.contains("dense is measured twice"), "{err}");
}

/// `folio eval fidelity` runs the RULER-style suite on a model whose spec has it (the
/// yardstick's language with random weights: the answers are wrong, the pipeline is what is
/// tested) and refuses it, saying why, on the demo model.
#[test]
fn fidelity_eval_runs_the_suite_where_the_model_has_it() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/yardstick-tiny");
    let out = tempfile::tempdir().unwrap();
    let args = ["--lengths", "1024", "--depths", "0.5", "--samples", "1", "--methods", "streaming", "--budgets", "64"];
    let run = folio(
        &[
            &["eval", "fidelity", "--model", tiny.to_str().unwrap(), "--tasks", "count,recite,two_hop"][..],
            &args[..],
            &["--out", out.path().to_str().unwrap()],
        ]
        .concat(),
        &[],
    );
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("fidelity.json")).unwrap()).unwrap();
    assert_eq!(doc["tasks"], serde_json::json!(["count", "recite", "two_hop"]));
    let outcomes = doc["runs"][1]["outcomes"].as_array().unwrap();
    let tasks: Vec<&str> = outcomes.iter().map(|o| o["task"].as_str().unwrap()).collect();
    assert_eq!(tasks, ["count", "recite", "two_hop"], "one prompt per task");
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("recite") && table.contains("two_hop"), "{table}");

    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let err = err_text(folio(&["eval", "fidelity", "--model", demo.to_str().unwrap(), "--tasks", "recite"], &[]));
    assert!(err.contains("no `ruler` section") && err.contains("yardstick"), "{err}");
}

/// `folio eval fidelity --prefill sparse` on a copy of the demo model at 1,024 tokens (knobs
/// small enough to be sparse there), read by `folio eval prefill-cost`: a row per length, and
/// with `--record` the model's answer-cost file, which `folio prefill --dry-run` then prints
/// beside the sparse prefill's time — saying so when it loses answers.
#[test]
fn a_sparse_prefills_cost_in_answers_is_recorded_and_shown_before_a_prefill() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let model = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&demo).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().is_some_and(|n| n != "prefill_answers.json") {
            std::fs::copy(&p, model.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let m = model.path().to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let mode = "sparse:block=16,keys=64,sinks=16,window=64";
    let eval = [
        "eval",
        "fidelity",
        "--model",
        m,
        "--lengths",
        "1024",
        "--tasks",
        "chain,pair",
        "--depths",
        "0.5",
        "--samples",
        "1",
        "--methods",
        "streaming",
        "--budgets",
        "64",
        "--offload",
        "--prefill",
        mode,
        "--out",
    ];
    let run = folio(&[&eval[..], &[out.path().to_str().unwrap()]].concat(), &[]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report = out.path().join("fidelity.json");
    let (r, measured) = (report.to_str().unwrap(), "a test run");
    let rows = ok_json(folio(&["eval", "prefill-cost", r, "--measured", measured, "--json"], &[]));
    let row = &rows[0];
    assert_eq!((rows.as_array().unwrap().len(), row["prefill"].as_str()), (1, Some(mode)), "{rows}");
    assert_eq!((row["length"].as_u64(), row["prompts"].as_u64()), (Some(1024), Some(2)), "{row}");
    assert_eq!(row["dense_answered"], 2, "the demo model answers both over a dense prefill");
    let table = folio(&["eval", "prefill-cost", r, "--measured", measured, "--record", "--model", m], &[]);
    assert!(table.status.success(), "{}", String::from_utf8_lossy(&table.stderr));
    assert!(String::from_utf8_lossy(&table.stdout).contains(mode), "the table");

    let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples");
    let planned = out.path().join("planned.folio");
    let (docs, planned) = (samples.to_str().unwrap(), planned.to_str().unwrap());
    let dry = ["prefill", "--dry-run", "--model", m, "--docs", docs, "--prefill", mode, "--out", planned];
    let shown = |args: &[&str]| {
        let run = folio(args, &[]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        String::from_utf8_lossy(&run.stdout).into_owned()
    };
    let text = shown(&dry);
    let right = format!("at 1024 tokens: {} of 2 answers right (over a dense prefill 2)", row["answered"]);
    assert!(text.contains(&format!("* prefill {mode}: working memory")) && text.contains(&right), "{text}");
    assert!(text.contains("  prefill dense:"), "{text}");
    // The default sparse prefill, offered too, has no rows in this copy.
    let default = text.split("  prefill sparse:block=64,").nth(1).unwrap_or_default();
    assert!(default.lines().nth(1).is_some_and(|l| l.contains("not measured on this model")), "{text}");
    // A recorded loss is said beside the time.
    let file = model.path().join("prefill_answers.json");
    let mut recorded: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    recorded["rows"][0]["answered"] = 1.into();
    recorded["rows"][0]["lost"] = 1.into();
    std::fs::write(&file, recorded.to_string()).unwrap();
    let text = shown(&dry);
    assert!(text.contains("1 of 2 answers right (over a dense prefill 2), KL"), "the edited row: {text}");
    assert!(text.contains("; it loses 1 a dense prefill answers right"), "the loss said: {text}");

    let err =
        err_text(folio(&["eval", "prefill-cost", demo.join("config.json").to_str().unwrap(), "--measured", "x"], &[]));
    assert!(err.contains("is not a report of `folio eval fidelity`"), "{err}");
}

#[test]
fn needle_eval_writes_table_json_and_heatmap() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    // `folio eval needle` on the demo model at 1k tokens, its report into `out`.
    let needle = |out: &Path, extra: &[&str]| {
        let mut args = vec!["eval", "needle", "--model", demo.to_str().unwrap(), "--lengths", "1k"];
        args.extend_from_slice(extra);
        args.extend(["--out", out.to_str().unwrap()]);
        folio(&args, &[])
    };
    let out = tempfile::tempdir().unwrap();
    let run = needle(out.path(), &["--depths", "0,1", "--samples", "2"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("1k |") && table.contains("overall"), "{table}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("needle.json")).unwrap()).unwrap();
    assert_eq!(doc["lengths"][0], 1024);
    assert_eq!(doc["results"].as_array().unwrap().len(), 4);
    assert_eq!(doc["complete"], true, "the report is rewritten after each cell, then marked complete");
    assert!(!out.path().join("needle.json.tmp").exists(), "the atomic write leaves no temporary file");
    assert!(doc["overall"].as_f64().unwrap() >= 0.75, "{}", doc["overall"]);
    let svg = std::fs::read_to_string(out.path().join("needle-heatmap.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<rect x=").count() == 2);

    // A miss keeps its prompt's token ids for another engine: streaming over 16 tokens cannot
    // see a fact at the start of a 1k-token prompt.
    let missed = tempfile::tempdir().unwrap();
    std::fs::create_dir(missed.path().join("misses")).unwrap();
    std::fs::write(missed.path().join("misses/4096-0.5-0.u32"), [0u8; 4]).unwrap();
    let run = needle(missed.path(), &["--depths", "0", "--samples", "1", "--method", "streaming:16"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("0/1 correct") && stderr.contains("sample 0: expected"), "{stderr}");
    let sample: Value =
        serde_json::from_str(&std::fs::read_to_string(missed.path().join("misses/1024-0-0.json")).unwrap()).unwrap();
    let ids = std::fs::read(missed.path().join("misses/1024-0-0.u32")).unwrap();
    assert_eq!(ids.len(), 4 * sample["prompt_tokens"].as_u64().unwrap() as usize);
    assert_eq!(u32::from_le_bytes(ids[..4].try_into().unwrap()), 0, "the prompt starts with <|bos|>");
    assert!(!missed.path().join("misses/4096-0.5-0.u32").exists(), "an earlier run's misses are cleared");

    // A model without eval_spec.json, an unknown method and a dense budget are clear errors.
    let err =
        err_text(folio(&["eval", "needle", "--model", fixture("llama").to_str().unwrap(), "--lengths", "1k"], &[]));
    assert!(err.contains("eval_spec.json"), "{err}");
    let err = err_text(folio(&["eval", "needle", "--model", demo.to_str().unwrap(), "--method", "magic"], &[]));
    assert!(err.contains("unknown attention method \"magic\"; available: dense"), "{err}");
    let err = err_text(folio(&["eval", "needle", "--model", demo.to_str().unwrap(), "--method", "dense:2048"], &[]));
    assert!(err.contains("takes no budget"), "{err}");

    // --offload with --methods: one prefill per prompt, a report folder per method; a method
    // without a fast path there is refused before any prompt is built.
    let several = tempfile::tempdir().unwrap();
    let run =
        needle(several.path(), &["--depths", "0", "--samples", "1", "--offload", "--methods", "dense,streaming:16"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report = |folder: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(several.path().join(folder).join("needle.json")).unwrap())
            .unwrap()
    };
    let (dense, streaming) = (report("dense"), report("streaming-16"));
    assert_eq!((dense["offload"].clone(), dense["method"].clone()), (Value::Bool(true), Value::from("dense")));
    assert_eq!(
        (streaming["method"].clone(), streaming["budget"].clone()),
        (Value::from("streaming"), Value::from("16"))
    );
    assert_eq!(dense["overall"], 1.0, "{dense}");
    assert_eq!(streaming["overall"], 0.0, "streaming over 16 tokens cannot see a fact at depth 0: {streaming}");
    assert_eq!(dense["results"][0]["prefill_seconds"], streaming["results"][0]["prefill_seconds"], "one prefill");
    assert!(several.path().join("streaming-16/misses/1024-0-0.u32").exists());
    let err = err_text(needle(several.path(), &["--offload", "--method", "topk-ivf:2%"]));
    assert!(err.contains("topk-ivf on the offloaded tier: no offloaded fast path"), "{err}");
    let err = err_text(needle(several.path(), &["--methods", "dense", "--method", "hip"]));
    assert!(err.contains("cannot be used with"), "{err}");

    // --prefill sparse:KNOBS (small enough to be sparse at 1k) on the offloaded tier: the
    // report names it; the resident tier, which prefills the whole prompt each run, refuses it.
    let sparse = tempfile::tempdir().unwrap();
    let mode = "sparse:block=16,keys=64,sinks=16,window=64";
    let run = needle(sparse.path(), &["--depths", "0.5", "--samples", "1", "--offload", "--prefill", mode]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(sparse.path().join("needle.json")).unwrap()).unwrap();
    assert_eq!((doc["prefill"].as_str(), doc["results"].as_array().map(Vec::len)), (Some(mode), Some(1)), "{doc}");
    let err = err_text(needle(sparse.path(), &["--depths", "0.5", "--samples", "1", "--prefill", mode]));
    assert!(err.contains("give --offload"), "{err}");
}

/// `--accept-other-weights` where it could do nothing (the window, the server) is refused, not
/// ignored.
#[test]
fn accepting_other_weights_is_refused_where_it_would_do_nothing() {
    for args in [&["--accept-other-weights"][..], &["serve", "--accept-other-weights"]] {
        let err = err_text(folio(args, &[]));
        assert!(err.contains("open only contexts made with the weights they load"), "{args:?}: {err}");
    }
}
