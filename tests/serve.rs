//! `folio serve` as its users meet it: the real binary on a port of its own, a real HTTP
//! client, the bundled demo model over the sample documents prefilled into a test library,
//! and the official `openai` Python client and docs/server.md's curl examples against it.

#[path = "common/cli.rs"]
mod cli;
#[path = "common/server.rs"]
mod server;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cli::{demo, folio_cmd, root, test_home};
use serde_json::{json, Value};
use server::{chat, content, Server};

const AMBER: &str = "what is the secret code of amber falcon ?";
const AMBER_ANSWER: &str = "the secret code of amber falcon is 4 8 1 5 2 .";
const JADE: &str = "what is the lucky number of jade tiger ?";
const JADE_ANSWER: &str = "the lucky number of jade tiger is 9 0 4 5 5 .";
const SAMPLES: &str = "context:samples";

/// The test library with the samples prefilled as the context `samples` (once per process).
fn samples_home() -> PathBuf {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let out = test_home().join("samples.folio");
        let samples = root().join("assets/samples");
        let demo = demo();
        let args = ["prefill", "--model", &demo, "--docs", samples.to_str().unwrap(), "--out", out.to_str().unwrap()];
        let run = folio_cmd(&args).output().unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        test_home()
    })
    .clone()
}

/// The tiny random-weights Llama of the fixtures (512 positions): fast, and it does not stop.
fn tiny() -> String {
    root().join("tests/fixtures/models/llama").display().to_string()
}

#[test]
fn answers_over_a_saved_context_as_openai_does() {
    let server = Server::start(&samples_home(), &["--model", &demo()], &[]);
    let (status, models) = server.get("/models");
    assert_eq!(status, 200, "{models}");
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert!(ids.contains(&SAMPLES), "{ids:?}");
    let bare = ids[0].to_owned();
    let samples = models["data"].as_array().unwrap().iter().find(|m| m["id"] == SAMPLES).unwrap();
    let context_tokens = samples["folio"]["tokens"].as_u64().unwrap();
    assert!(context_tokens > 500, "{samples}");
    assert_eq!(server.get(&format!("/models/{SAMPLES}")).1["id"], SAMPLES);

    // A question over the context, answered from the documents with no prefill.
    let (status, r) = server.post("/chat/completions", &chat(SAMPLES, AMBER));
    assert_eq!(status, 200, "{r}");
    assert_eq!(content(&r), AMBER_ANSWER);
    assert_eq!(
        (r["object"].as_str(), r["choices"][0]["finish_reason"].as_str()),
        (Some("chat.completion"), Some("stop"))
    );
    let usage = &r["usage"];
    let (prompt, completion) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap());
    assert!(prompt > context_tokens && completion > 5, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));

    // The follow-up, sent with the whole conversation as OpenAI clients do: its earlier turns
    // are held from the first request, only the new one computed.
    let follow = json!({ "model": SAMPLES, "temperature": 0, "messages": [
        { "role": "user", "content": AMBER }, { "role": "assistant", "content": AMBER_ANSWER },
        { "role": "user", "content": JADE }] });
    let (status, r) = server.post("/chat/completions", &follow);
    assert_eq!((status, content(&r)), (200, JADE_ANSWER), "{r}");
    assert!(r["folio"]["reused_tokens"].as_u64().unwrap() > context_tokens, "{r}");
    // Which prefill made the context's tokens: the samples' context was prefilled densely.
    let made = &r["folio"]["prefill"];
    assert_eq!((made[0]["mode"].as_str(), made[0]["to"].as_u64()), (Some("dense"), Some(context_tokens)), "{r}");

    // Streamed, with the usage asked for: a role chunk, the text in pieces, the finish, the
    // usage, [DONE].
    let mut body = chat(SAMPLES, JADE);
    body["stream"] = json!(true);
    body["stream_options"] = json!({ "include_usage": true });
    let (status, events) = server.stream("/chat/completions", &body);
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, JADE_ANSWER);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<&Value> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "stop");
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        chunks.last().unwrap()["choices"].as_array().unwrap().is_empty()
            && usage["completion_tokens"].as_u64() > Some(5)
    );

    // Another attention method on the same saved context, named in the `folio` extension.
    let mut hip = chat(SAMPLES, AMBER);
    hip["folio"] = json!({ "method": "hip" });
    let (status, r) = server.post("/chat/completions", &hip);
    assert_eq!((status, content(&r)), (200, AMBER_ANSWER), "{r}");
    assert!(r["folio"]["method"].to_string().contains("hip"), "{r}");

    // The bare model, with a limit; and a raw-text completion.
    let mut short = chat(&bare, "hello");
    short["max_tokens"] = json!(3);
    let (status, r) = server.post("/chat/completions", &short);
    assert_eq!(status, 200, "{r}");
    assert!(r["usage"]["completion_tokens"].as_u64() <= Some(3), "{r}");
    let (status, r) =
        server.post("/completions", &json!({ "model": bare, "prompt": "the secret code of", "max_tokens": 3 }));
    assert_eq!((status, r["object"].as_str()), (200, Some("text_completion")), "{r}");
    assert!(r["choices"][0]["text"].is_string() && r["usage"]["completion_tokens"].as_u64() <= Some(3), "{r}");
    assert!(server.log().contains("model=context:samples"), "{}", server.log());
}

/// Every refusal as OpenAI's error object with the status a client maps: 400, 401, 404, 413.
#[test]
fn refuses_with_openai_errors() {
    let server = Server::start(&samples_home(), &["--model", &demo()], &[]);
    let (status, e) = server.post_raw("/chat/completions", "{\"model\": ");
    assert_eq!((status, e["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{e}");
    let mut cases = vec![
        (
            json!({ "model": SAMPLES, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {} }),
            400,
            "logit_bias",
        ),
        (json!({ "model": SAMPLES, "messages": [{"role": "user", "content": "hi"}], "n": 2 }), 400, "one choice"),
        (
            json!({ "model": SAMPLES, "messages": [{"role": "user", "content": "hi"}], "temperature": -1 }),
            400,
            "temperature",
        ),
        (json!({ "model": SAMPLES, "messages": [{"role": "assistant", "content": "hi"}] }), 400, "the user's question"),
        (json!({ "model": SAMPLES, "messages": [{"role": "tool", "content": "hi"}] }), 400, "no tools"),
        (
            json!({ "model": SAMPLES, "messages": [{"role": "user", "content": "hi"}], "folio": {"method": "nonsense"} }),
            400,
            "folio.method",
        ),
        (json!({ "model": "context:nowhere", "messages": [{"role": "user", "content": "hi"}] }), 404, SAMPLES),
    ];
    // A context keeps the system prompt it was prefilled with.
    cases.push((json!({ "model": SAMPLES, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}] }), 400, "system prompt"));
    for (body, want, says) in cases {
        let (status, e) = server.post("/chat/completions", &body);
        assert_eq!(status, want, "{body}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    let (status, e) = server.post("/chat/completions", &chat("context:nowhere", "hi"));
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("model_not_found")), "{e}");
    let (status, e) = server.post("/completions", &json!({ "model": SAMPLES, "prompt": "hi" }));
    assert_eq!(status, 400, "{e}");
    assert_eq!(server.get("/nowhere").0, 404);
    // What a web page could send: another site's Host (DNS rebinding), a body that is not JSON.
    let url = format!("{}/models", server.base);
    let mut r = server.agent.get(&url).header("Host", "evil.example:8642").call().unwrap();
    let e: Value = r.body_mut().read_json().unwrap();
    assert_eq!(r.status().as_u16(), 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("this machine only"), "{e}");
    let body = chat(SAMPLES, AMBER).to_string();
    let chat_url = format!("{}/chat/completions", server.base);
    let mut r = server.agent.post(&chat_url).header("Content-Type", "text/plain").send(&body).unwrap();
    let e: Value = r.body_mut().read_json().unwrap();
    assert_eq!(r.status().as_u16(), 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("as JSON"), "{e}");
    drop(server);

    // A prompt longer than the model reads: 413, nothing truncated.
    let server = Server::start(&samples_home(), &["--model", &tiny(), "--no-library"], &[]);
    let model = server.get("/models").1["data"][0]["id"].as_str().unwrap().to_owned();
    let (status, e) = server.post("/chat/completions", &chat(&model, &"hello ".repeat(600)));
    assert_eq!((status, e["error"]["code"].as_str()), (413, Some("context_length_exceeded")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("nothing was truncated"), "{e}");
    drop(server);

    // A key: none or a wrong one is 401, the right one answers.
    let server = Server::start(&samples_home(), &["--model", &tiny(), "--no-library", "--api-key", "s3cret"], &[]);
    let url = format!("{}/models", server.base);
    for key in [None, Some("Bearer wrong")] {
        let mut request = server.agent.get(&url);
        if let Some(k) = key {
            request = request.header("Authorization", k);
        }
        let mut r = request.call().unwrap();
        let e: Value = r.body_mut().read_json().unwrap();
        assert_eq!((r.status().as_u16(), e["error"]["code"].as_str()), (401, Some("invalid_api_key")), "{e}");
    }
    let r = server.agent.get(&url).header("Authorization", "Bearer s3cret").call().unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

/// A client that goes stops its answer: the next request does not wait for the tokens nobody
/// reads (streamed or not), and the log says the answer was cancelled.
#[test]
fn a_client_that_goes_stops_its_answer() {
    // 200 ms a piece of text: the tiny model's greedy answer to "hello" (about 65 pieces) would
    // take some 13 s if nobody stopped it.
    let hooks = [("FOLIO_TEST_HOOKS", "1"), ("FOLIO_TEST_TOKEN_DELAY_MS", "200")];
    let server = Server::start(&samples_home(), &["--model", &tiny(), "--no-library"], &hooks);
    let model = server.get("/models").1["data"][0]["id"].as_str().unwrap().to_owned();
    let mut long = chat(&model, "hello");
    long["max_tokens"] = json!(400);
    long["stream"] = json!(true);
    let r = server.agent.post(format!("{}/chat/completions", server.base)).send_json(&long).unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    let pieces = lines.by_ref().map_while(Result::ok).filter(|l| l.starts_with("data: ")).take(4).count();
    assert_eq!(pieces, 4);
    drop(lines);
    let mut short = chat(&model, "hello");
    short["max_tokens"] = json!(1);
    let started = Instant::now();
    assert_eq!(server.post("/chat/completions", &short).0, 200);
    assert!(started.elapsed() < Duration::from_secs(6), "waited {:?}: {}", started.elapsed(), server.log());

    // Not streamed: the client gives up after a second (its agent, and so its connection, gone).
    long["stream"] = json!(false);
    {
        let impatient: ureq::Agent =
            ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(1))).build().into();
        assert!(impatient.post(format!("{}/chat/completions", server.base)).send_json(&long).is_err());
    }
    let started = Instant::now();
    assert_eq!(server.post("/chat/completions", &short).0, 200);
    assert!(started.elapsed() < Duration::from_secs(6), "waited {:?}: {}", started.elapsed(), server.log());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(server.log().matches("stop=Cancelled").count(), 2, "{}", server.log());
}

/// Many clients at once against a short queue: every request answered or refused with 429 at
/// once, none lost, the server alive afterwards.
#[test]
fn a_full_queue_refuses_with_429_and_loses_nothing() {
    let hooks = [("FOLIO_TEST_HOOKS", "1"), ("FOLIO_TEST_TOKEN_DELAY_MS", "20")];
    let server = Server::start(&samples_home(), &["--model", &tiny(), "--no-library", "--queue", "2"], &hooks);
    let model = server.get("/models").1["data"][0]["id"].as_str().unwrap().to_owned();
    let (clients, each) = (12, 3);
    let results: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let mut body = chat(&model, "hello");
                    body["max_tokens"] = json!(6);
                    (0..each).map(|_| server.post("/chat/completions", &body)).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len(), clients * each);
    let answered =
        results.iter().filter(|(s, r)| *s == 200 && r["choices"][0]["message"]["content"].is_string()).count();
    let busy = results.iter().filter(|(s, r)| *s == 429 && r["error"]["code"] == "rate_limit_exceeded").count();
    assert_eq!(answered + busy, results.len(), "{results:?}");
    assert!(answered >= 3 && busy >= 1, "answered {answered}, busy {busy}");
    assert_eq!(server.get("/models").0, 200);
    assert_eq!(server.post("/chat/completions", &chat(&model, "hello")).0, 200);
}

/// The official `openai` Python client (PyPI) and every curl example of docs/server.md, run
/// against the server as written there (only the port differs).
#[test]
fn the_openai_client_and_the_docs_examples_work() {
    let server = Server::start(&samples_home(), &["--model", &demo()], &[]);
    let py_cache = std::env::var("HOME").map(|h| format!("{h}/.cache/folio-py")).unwrap_or_default();
    let python_path = match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{py_cache}:{p}"),
        _ => py_cache,
    };
    let script = root().join("tests/serve/openai_client.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(&server.base)
        .env("PYTHONPATH", &python_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}\n(the test command installs openai: python3 -m pip install --target ~/.cache/folio-py openai)",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let docs = std::fs::read_to_string(root().join("docs/server.md")).unwrap();
    let examples: Vec<&str> =
        docs.split("```sh\n").skip(1).filter_map(|b| b.split("```").next()).filter(|b| b.contains("curl")).collect();
    assert!(examples.len() >= 3, "docs/server.md has {} curl examples", examples.len());
    for example in examples {
        let example = example.replace("http://127.0.0.1:8642/v1", &server.base);
        let out = std::process::Command::new("bash").args(["-euo", "pipefail", "-c", &example]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !stdout.contains("\"error\""),
            "{example}\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
