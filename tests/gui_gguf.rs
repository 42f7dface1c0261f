//! GGUF models in the window, as a person with LM Studio's files meets them (issue #46): Settings
//! lists the .gguf files of LM Studio's model folder with their architecture, quantisation and
//! size, and why one cannot run; a click loads one and the model facts show its quantisation; a
//! .gguf dropped on the window loads it; documents dropped then are prefilled by it and a
//! question is answered over them. The real window under Xvfb through WebDriver, with HOME set
//! to a folder holding LM Studio's layout. Screenshots: docs/app/gguf-*.png.

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use std::path::Path;

use serde_json::json;

use webdriver::{drop_paths, open_settings, screenshot, statuses, tauri_driver_with, Driver, ENTER};
use xvfb::start_xvfb;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf").join(name).canonicalize().unwrap()
}

fn running(d: &Driver) -> String {
    d.texts(".model-name").first().cloned().unwrap_or_default()
}

#[test]
fn gguf_files_are_listed_loaded_dropped_and_answer() {
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let user = tempfile::tempdir().unwrap();
    // LM Studio's layout: publisher/repo/file.gguf; one file cut short beside it.
    let lm = user.path().join(".lmstudio/models/folio/llama256-GGUF");
    std::fs::create_dir_all(&lm).unwrap();
    std::fs::copy(fixture("llama256-Q4_K_M.gguf"), lm.join("llama256-Q4_K_M.gguf")).unwrap();
    let whole = std::fs::read(fixture("llama256-Q8_0.gguf")).unwrap();
    std::fs::write(lm.join("llama256-Q8_0.gguf"), &whole[..whole.len() / 2]).unwrap();
    let user_home = user.path().to_str().unwrap();
    let (_td, base) = tauri_driver_with(&display, home.path(), "tauri-driver-gguf.log", &[("HOME", user_home)]);
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    d.wait("the demo model running", |d| running(d) == "demo");

    // Settings lists both files: the whole one with its facts, the cut one with why.
    open_settings(&d);
    d.wait("the GGUF files listed", |d| d.texts("[data-testid=gguf-models] li").len() == 2);
    let items = d.texts("[data-testid=gguf-models] li");
    assert!(items[0].contains("llama256-Q4_K_M.gguf") && items[0].contains("llama · Q4_K_M · 916.0 KiB"), "{items:?}");
    assert!(items[1].contains("llama256-Q8_0.gguf") && items[1].contains("truncated"), "{items:?}");
    d.script("document.querySelector('[data-testid=gguf-models]').scrollIntoView({block: 'center'})", json!([]));
    screenshot(&display, "gguf-1-listed");
    d.click("[data-testid=gguf-models] li:first-child button");
    d.wait("the Q4_K_M file running", |d| running(d) == "llama256-Q4_K_M.gguf");
    d.wait("its weights in the facts", |d| !d.texts("[data-testid=model-weights]").is_empty());
    let weights = d.texts("[data-testid=model-weights]").concat();
    assert!(weights.contains("Q4_K_M · 4.96 bits/weight · 900.1 KiB"), "{weights}");
    d.script("document.querySelector('[data-testid=model-facts]').scrollIntoView({block: 'start'})", json!([]));
    screenshot(&display, "gguf-2-facts");
    d.click("[aria-label='Close settings']");

    // A .gguf dropped on the window runs; documents dropped then are prefilled with it.
    drop_paths(&d, &[&fixture("llama256-Q6_K.gguf")]);
    d.wait("the dropped file running", |d| running(d) == "llama256-Q6_K.gguf");
    let doc = user.path().join("harbor.txt");
    std::fs::write(&doc, "The harbor master of Port Evelyn is Marta Quist. She keeps a green lantern.\n").unwrap();
    drop_paths(&d, &[&doc]);
    d.wait("one staged document", |d| d.texts("[data-testid=staged-documents] tbody tr").len() == 1);
    d.click("[data-testid=start-prefill]");
    d.wait("the context ready", |d| statuses(d) == [("harbor".into(), "ready".into())]);
    d.click("[data-testid=context] .ctx-button");
    d.wait("the open button", |d| d.element("[data-testid=open-context]").is_some());
    d.click("[data-testid=open-context]");
    d.wait("the chat over harbor", |d| d.texts("[data-testid=open-context-chip]").concat().contains("harbor"));
    d.type_into("#composer-input", &format!("Who is the harbor master?{ENTER}"));
    d.wait("an answer", |d| d.texts(".bubble.assistant.done .text").first().is_some_and(|t| !t.is_empty()));
    let stats = d.texts("[data-testid=answer-stats]").concat();
    assert!(stats.starts_with("dense · first token"), "{stats}");
    screenshot(&display, "gguf-3-answer");
    d.quit();
}
