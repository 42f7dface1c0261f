//! Where a question goes, in the real window (issue #44): the composer names its target, a
//! question typed under a context's panel is asked over that context in a new chat (never a
//! hidden one), "New chat" and Ctrl+N start a chat over the same context with the context's
//! default method (not the method another chat applied), and Esc stops an answer as the Stop
//! button does, and a restart opens the chat shown last. The app under Xvfb through WebDriver, keys pressed as a person presses them.

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use std::process::Command;

use serde_json::json;
use webdriver::{
    choose_method, invoke, open_settings, prefill_samples, screenshot, statuses, tauri_driver, Driver, ENTER, ESC,
};
use xvfb::start_xvfb;

/// WebDriver's Control key, and the key that releases every modifier held.
const CONTROL: &str = "\u{E009}";
const RELEASE: &str = "\u{E000}";
/// What the demo model answers to the samples' first question (assets/SAMPLES.md).
const QUESTION: &str = "what is the secret code of amber falcon ?";
const ANSWER: &str = "4 8 1 5 2";
/// Milliseconds each answer token waits while the test stops an answer mid-way.
const SLOW_TOKEN_MS: u64 = 400;

fn target(d: &Driver) -> String {
    d.texts("[data-testid=composer-target]").concat()
}

fn answers(d: &Driver) -> Vec<String> {
    d.texts(".bubble.assistant.done .text")
}

fn stats(d: &Driver) -> Vec<String> {
    d.texts("[data-testid=answer-stats]")
}

fn slow_tokens(d: &Driver, ms: u64) {
    invoke(d, "simulate_slow_tokens", json!({ "ms": ms }));
}

fn method_in_settings(d: &Driver) -> String {
    open_settings(d);
    let method = d.script("return document.querySelector('[data-testid=method]').value", json!([]));
    d.click("[aria-label='Close settings']");
    method.as_str().unwrap_or_default().to_owned()
}

#[test]
fn questions_go_where_the_person_is_looking() {
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let (_td, base) = tauri_driver(&display, home.path(), "tauri-driver-chat.log");
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    d.wait("the model", |d| !target(d).is_empty());

    // Nothing open: the composer says the question goes to the model alone.
    assert_eq!(target(&d), "Asks the model alone — no documents · new chat");
    prefill_samples(&d);

    // The context's panel on screen: the question is asked over it, in a new chat, and the
    // answer appears where the person looks.
    d.click("[data-testid=context] .ctx-button");
    d.wait("the context's documents", |d| d.texts("[data-testid=context-documents] tbody tr").len() == 3);
    assert_eq!(target(&d), "Asks samples · new chat");
    d.type_into("#composer-input", &format!("{QUESTION}{ENTER}"));
    d.wait("the answer over samples", |d| answers(d).len() == 1);
    assert!(answers(&d)[0].contains(ANSWER), "{:?}", answers(&d));
    assert!(d.texts("[data-testid=open-context-chip]").concat().contains("samples"));
    d.wait("the chat saved", |d| target(d).starts_with("Asks samples · in “"));
    screenshot(&display, "18-composer-target");
    // The paperclip adds to the context the chat is over, not a new one.
    d.click("[aria-label='Add documents']");
    d.wait("the sheet", |d| !d.texts("#staging-title").is_empty());
    assert_eq!(d.texts("#staging-title").concat(), "Add to samples");
    d.type_into("#composer-input", ESC);
    d.wait("the sheet closed", |d| d.texts("#staging-title").is_empty());

    // Settings in a person's words: the method's knobs wait under Advanced, and a budget
    // larger than the context is applied with a note that the method reads every row.
    open_settings(&d);
    d.wait("the methods", |d| d.texts("[data-testid=method] option").len() >= 8);
    d.script(
        "const s = document.querySelector('[data-testid=method]'); s.value = 'hip'; \
         s.dispatchEvent(new Event('change', {bubbles: true}));",
        json!([]),
    );
    d.wait("hip's form", |d| d.element("[data-testid=advanced]").is_some());
    let advanced = d.script("return document.querySelector('details.advanced').open", json!([]));
    assert_eq!(advanced, json!(false), "the knobs are under Advanced, closed");
    d.type_into("[data-testid=budget]", "99999999");
    d.script("document.querySelector('[data-testid=apply-method]').click()", json!([]));
    d.wait("the note on the budget", |d| {
        d.texts("[data-testid=method-note]").concat().contains("99,999,999 tokens covers this whole context")
    });
    screenshot(&display, "20-budget-note");
    hip_knobs_opened(&d, &display);
    d.click("[aria-label='Close settings']");

    // A method applied in this chat does not carry over: Ctrl+N starts a new chat over the
    // same context with its default (none set: dense).
    choose_method(&d, "hip");
    d.type_into("#composer-input", &format!("{CONTROL}n{RELEASE}"));
    d.wait("a new, empty chat", |d| d.texts(".bubble").is_empty());
    assert!(d.texts("[data-testid=open-context-chip]").concat().contains("samples"));
    assert_eq!(target(&d), "Asks samples · new chat");
    assert_eq!(method_in_settings(&d), "dense");
    // The header's New chat does the same.
    d.type_into("#composer-input", &format!("{QUESTION}{ENTER}"));
    d.wait("the answer", |d| answers(d).len() == 1);
    assert!(
        d.texts("[data-testid=answer-stats]")[0].starts_with("dense"),
        "{:?}",
        d.texts("[data-testid=answer-stats]")
    );
    d.click("[data-testid=new-chat]");
    d.wait("a new, empty chat", |d| d.texts(".bubble").is_empty());

    // Esc stops an answer, as the Stop button does.
    slow_tokens(&d, SLOW_TOKEN_MS);
    d.type_into("#composer-input", &format!("{QUESTION}{ENTER}"));
    d.wait("the answer streaming", |d| !d.texts(".bubble.assistant.streaming .text").concat().trim().is_empty());
    d.type_into("#composer-input", ESC);
    d.wait("the answer stopped", |d| d.element(".bubble.assistant.stopped").is_some());
    slow_tokens(&d, 0);
    d.wait("the stopped turn saved", |d| target(d).starts_with("Asks samples · in “"));
    let stopped_chat = target(&d);
    assert!(stats(&d).last().is_some_and(|s| s.contains("Stopped · ")), "{:?}", stats(&d));

    // A restart opens the chat shown last, its stopped answer read back as it was shown.
    d.quit();
    let d = Driver::start(&base);
    d.wait("the last chat reopened", |d| d.element(".bubble.assistant").is_some());
    assert_eq!(target(&d), stopped_chat);
    assert!(stats(&d).last().is_some_and(|s| s.contains("Stopped · ")), "{:?}", stats(&d));

    // The context removed from a terminal while its chat is on screen: the window follows the
    // library, keeps the chat readable and says so in words, never by an internal id.
    d.click("[data-testid=new-chat]");
    d.type_into("#composer-input", &format!("{QUESTION}{ENTER}"));
    d.wait("the answer", |d| answers(d).len() == 1);
    let file = home.path().join("contexts/samples.folio");
    let removed = Command::new(env!("CARGO_BIN_EXE_folio"))
        .args(["library", "remove", file.to_str().unwrap()])
        .env("FOLIO_HOME", home.path())
        .output()
        .unwrap();
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    d.wait("samples gone from the sidebar", |d| statuses(d).is_empty());
    d.wait("the chat kept read-only", |d| {
        d.texts("[data-testid=chat-refused]").concat()
            == "samples was removed from the library; this chat is kept read-only"
    });
    assert_eq!(answers(&d).len(), 1, "the chat stays on screen");
    screenshot(&display, "19-context-removed");
    assert_eq!(target(&d), "Asks the model alone — no documents · new chat");
    let page = d.texts("body").concat();
    assert!(!page.contains("no chat") && !page.contains("no context"), "{page}");
    d.quit();
}

/// Settings' Advanced on hip, clicked open: its six knobs with the papers' defaults as
/// placeholders — among them where its search runs (cpu_search: 2, the CPU under a slow host
/// link), its meaning in the tooltip.
fn hip_knobs_opened(d: &Driver, display: &str) {
    d.click("[data-testid=advanced]");
    d.wait("hip's knobs", |d| d.element("[data-testid=knob-cpu_search]").is_some());
    d.script("document.querySelector('[data-testid=knob-cpu_search]').scrollIntoView({block: 'center'})", json!([]));
    let knob = d.script(
        "const k = document.querySelector('[data-testid=knob-cpu_search]'); \
         return [k.placeholder, k.closest('label').title, document.querySelectorAll('details.advanced input').length]",
        json!([]),
    );
    assert_eq!(knob[0], json!("2 (default)"), "{knob}");
    assert!(knob[1].as_str().is_some_and(|t| t.contains("40 GB/s")), "{knob}");
    assert_eq!(knob[2], json!(6), "hip's six knobs: {knob}");
    screenshot(display, "20b-hip-knobs");
}
