//! The local API from the window (issue #45): Settings → Local API serves the window's model
//! and the library's contexts to any OpenAI client on this machine — switched on as a person
//! does (a port typed, the switch clicked), asked from a real HTTP client over the context the
//! window prefilled, switched off (nothing listens), remembered across a restart — and the log's
//! folder is shown, with the window's own steps in it. And a model from the hub: a repo id typed
//! is looked up (its facts, the download's size), downloaded with progress, cancelled, resumed
//! and loaded. The app under Xvfb through WebDriver.

#[path = "common/hub.rs"]
mod hub;
#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use webdriver::{open_settings, prefill_samples, screenshot, tauri_driver, tauri_driver_with, Driver};
use xvfb::start_xvfb;

/// What the demo model answers to the samples' first question (assets/SAMPLES.md).
/// The two windows of this file run one after the other: side by side, the download test's
/// second download (after a cancel) hung past its 120 s step in 2 of 5 runs on this 2-core
/// machine and never alone (a hang under contention, not yet explained: the closing note of
/// 2026-11-29 says what is known).
static ONE_WINDOW_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const QUESTION: &str = "what is the secret code of amber falcon ?";
const ANSWER: &str = "the secret code of amber falcon is 4 8 1 5 2 .";

/// A port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The URL Settings shows once the API listens.
fn shown_url(d: &Driver) -> Option<String> {
    let text = d.texts("[data-testid=server-url] code").into_iter().next()?;
    text.starts_with("http://").then_some(text)
}

fn open_local_api(d: &Driver) {
    open_settings(d);
    d.wait("the local API's status", |d| {
        d.script("return document.querySelector('[data-testid=server-switch]')?.matches(':enabled')", json!([]))
            == json!(true)
    });
    d.script("document.querySelector('[data-testid=local-api]').scrollIntoView()", json!([]));
}

#[test]
fn the_window_serves_its_model_and_contexts_to_openai_clients() {
    let _one = ONE_WINDOW_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let (_td, base) = tauri_driver(&display, home.path(), "tauri-driver-server.log");
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    prefill_samples(&d);

    // Off at first; a port typed and the switch clicked: the address a person gives an editor.
    open_local_api(&d);
    assert!(shown_url(&d).is_none());
    let port = free_port();
    d.script(
        "const p = document.querySelector('[data-testid=server-port]'); p.value = arguments[0]; \
         p.dispatchEvent(new Event('input', {bubbles: true}));",
        json!([port.to_string()]),
    );
    d.click("[data-testid=server-switch]");
    d.wait("the API's address", |d| shown_url(d).is_some());
    let url = shown_url(&d).unwrap();
    assert_eq!(url, format!("http://127.0.0.1:{port}/v1"));
    screenshot(&display, "21-local-api");

    // Any OpenAI client on this machine: the context the window prefilled is a model.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let models: Value = agent.get(format!("{url}/models")).call().unwrap().body_mut().read_json().unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert!(ids.contains(&"context:samples"), "{models}");
    let body =
        json!({ "model": "context:samples", "temperature": 0, "messages": [{ "role": "user", "content": QUESTION }] });
    let answer: Value =
        agent.post(format!("{url}/chat/completions")).send_json(&body).unwrap().body_mut().read_json().unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], ANSWER, "{answer}");

    // The log's folder, shown, with the window's steps (the prefill, the model) in it.
    let folder = d.texts("[data-testid=log-folder]").concat();
    assert_eq!(Path::new(&folder), home.path().join("logs"));
    let log: String =
        std::fs::read_dir(&folder).unwrap().map(|f| std::fs::read_to_string(f.unwrap().path()).unwrap()).collect();
    assert!(log.contains("context written") && log.contains("served"), "{log}");
    assert!(!log.contains("falcon"), "the log holds a question's text: {log}");

    // A restart: the API is on again, at the same address.
    d.quit();
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    open_local_api(&d);
    d.wait("the API's address again", |d| shown_url(d).as_deref() == Some(url.as_str()));
    assert_eq!(agent.get(format!("{url}/models")).call().unwrap().status().as_u16(), 200);

    // Off: nothing listens any more.
    d.click("[data-testid=server-switch]");
    d.wait("the API off", |d| shown_url(d).is_none());
    assert!(agent.get(format!("{url}/models")).call().is_err(), "still listening after the switch went off");
    d.quit();
}

/// Settings → Change model with a repo id the cache lacks, against a hub on loopback that sends
/// the weights slowly: the facts and the size first, then the download with its progress, a
/// Cancel that keeps what arrived, a second Download that goes on from it, and the model loaded.
#[test]
fn the_window_downloads_a_model_with_progress_and_cancel() {
    let _one = ONE_WINDOW_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let hf = tempfile::tempdir().unwrap();
    let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama");
    let faults = hub::Faults { slow: Some(Duration::from_millis(60)), ..hub::Faults::default() };
    let hub = hub::Hub::start(&llama, "llama", faults);
    let env = [("HF_HOME", hf.path().to_str().unwrap()), ("HF_ENDPOINT", hub.endpoint.as_str())];
    let (_td, base) = tauri_driver_with(&display, home.path(), "tauri-driver-download.log", &env);
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    open_settings(&d);
    d.script("document.querySelector('[data-testid=model-switch]').scrollIntoView()", json!([]));
    d.type_into("[data-testid=model-spec]", "folio-test/llama");
    d.click("[data-testid=load-model]");
    d.wait("the download's facts", |d| d.element("[data-testid=download-card]").is_some());
    let card = d.texts("[data-testid=download-card]").concat();
    assert!(card.contains("folio-test/llama") && card.contains("llama") && card.contains("parameters"), "{card}");
    assert!(d.texts("[data-testid=download-size]").concat().contains("6 files"), "{card}");
    screenshot(&display, "22-download-facts");

    // Download, with progress; Cancel keeps what arrived.
    d.click("[data-testid=start-download]");
    d.wait("a tenth of the weights", |d| {
        d.script("return document.querySelector('[data-testid=download-progress]')?.value ?? 0", json!([]))
            .as_f64()
            .is_some_and(|v| v > 60_000.0)
    });
    screenshot(&display, "23-download-progress");
    d.click("[data-testid=cancel-download]");
    d.wait("the download stopped", |d| d.texts("[data-testid=download-note]").concat().contains("stopped"));
    d.wait("what is left to fetch", |d| d.texts("[data-testid=download-size]").concat().contains("here already"));

    // Download again: it goes on from what arrived, then the model loads.
    d.click("[data-testid=start-download]");
    d.wait("the downloaded model running, or why not", |d| {
        d.texts(".model-name").concat().contains("llama") || !d.texts("[data-testid=download-note]").is_empty()
    });
    assert!(d.texts("[data-testid=download-note]").is_empty(), "{:?}", d.texts("[data-testid=download-note]"));
    assert!(hub.ranges() >= 1, "the second download started over");
    d.quit();
}
