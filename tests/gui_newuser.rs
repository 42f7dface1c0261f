//! A new user's first session, as issue #44 recorded one: a fresh Folio home, the window's
//! first start, the samples dropped and prefilled, every question of assets/SAMPLES.md typed
//! and sent with Enter (each answer checked where it appears), Settings → Attention's choices
//! (speeds measured here, the recommended method, a method picked and applied), a restart,
//! and the conversation continued in the chat shown last. The real window under Xvfb through
//! WebDriver; its screenshots are docs/app/new-user-*.png (`tools/new-user-session.sh` runs
//! it and copies them there).

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use serde_json::json;
use webdriver::{open_settings, prefill_samples, screenshot, tauri_driver, Driver, ENTER};
use xvfb::start_xvfb;

/// The questions and answers of assets/SAMPLES.md's table, read as `folio eval sources` reads it.
fn samples() -> Vec<(String, String)> {
    let table = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/SAMPLES.md")).unwrap();
    let rows: Vec<(String, String)> =
        folio_eval::sources::sample_questions(&table).unwrap().into_iter().map(|q| (q.question, q.answer)).collect();
    assert_eq!(rows.len(), 9, "SAMPLES.md's nine questions");
    rows
}

fn answers(d: &Driver) -> Vec<String> {
    d.texts(".bubble.assistant.done .text")
}

/// Lower case, single spaces: SAMPLES.md's comparison.
fn normalized(s: &str) -> String {
    s.to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ")
}

fn ask(d: &Driver, question: &str, answer: &str) {
    let before = answers(d).len();
    d.type_into("#composer-input", &format!("{question}{ENTER}"));
    d.wait("the answer", |d| answers(d).len() == before + 1);
    let got = answers(d).pop().unwrap_or_default();
    assert_eq!(normalized(&got), normalized(answer), "{question}");
}

#[test]
fn a_new_users_first_session() {
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let (_td, base) = tauri_driver(&display, home.path(), "tauri-driver-newuser.log");
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    d.wait("the welcome", |d| !d.texts("[data-testid=composer-target]").concat().is_empty());
    assert_eq!(d.texts("[data-testid=composer-target]").concat(), "Asks the model alone — no documents · new chat");
    screenshot(&display, "new-user-1-first-start");

    prefill_samples(&d);
    d.click("[data-testid=context] .ctx-button");
    d.wait("the context's documents", |d| d.texts("[data-testid=context-documents] tbody tr").len() == 3);
    // Each question in a chat of its own, as the samples are meant (New chat keeps the context).
    let questions = samples();
    for (i, (q, a)) in questions.iter().enumerate() {
        if i > 0 {
            d.click("[data-testid=new-chat]");
            d.wait("a new, empty chat", |d| d.texts(".bubble").is_empty());
        }
        ask(&d, q, a);
    }
    d.wait("nine chats", |d| d.texts("[data-testid=chat]").len() == 9);
    screenshot(&display, "new-user-2-every-sample");

    // Settings → Attention: dense's speed here comes from the nine answers; Measure times the
    // methods that keep dense's answers; one is recommended, in words; a choice is applied.
    open_settings(&d);
    d.wait("the method choices", |d| d.element("[data-testid=method-choices]").is_some());
    let dense = d.texts("[data-testid=choice-dense] .speed").concat();
    assert!(dense.ends_with("tokens/s here"), "{dense}");
    assert!(d.texts("[data-testid=choice-hip] .speed").concat().contains("not measured"));
    d.script("document.querySelector('[data-testid=measure-methods]').click()", json!([]));
    d.wait("the speeds measured", |d| {
        let failed = d.texts("[data-testid=method-choices] [role=alert]").concat();
        assert!(failed.is_empty(), "measuring failed: {failed}");
        d.element("[data-testid=measure-progress]").is_none()
            && d.texts("[data-testid=choice-hip] .speed").concat().ends_with("tokens/s here")
    });
    assert!(d.element("[data-testid=all-measured]").is_some(), "nothing is left to measure");
    for kept in ["topk", "magicpig"] {
        let speed = d.texts(&format!("[data-testid=choice-{kept}] .speed")).concat();
        assert!(speed.ends_with("tokens/s here"), "{kept}: {speed}");
    }
    // Methods that lose answers are shown as such and not measured.
    assert!(d.texts("[data-testid=choice-streaming] .speed").concat().contains("not measured"));
    let why = d.texts("[data-testid=recommendation]").concat();
    assert!(why.starts_with("Recommended for this context"), "{why}");
    assert!(why.contains("tokens/s here"), "{why}");
    screenshot(&display, "new-user-3-method-choices");
    d.script("document.querySelector('[data-testid=choice-hip]').click()", json!([]));
    let picked = d.script("return document.querySelector('[data-testid=method]').value", json!([]));
    assert_eq!(picked, json!("hip"));
    d.script("document.querySelector('[data-testid=apply-method]').click()", json!([]));
    d.wait("hip applied", |d| d.texts("[role=status]").concat().contains("The next answer uses hip"));
    d.click("[aria-label='Close settings']");
    let (q, a) = &questions[1];
    ask(&d, q, a);
    let footer = d.texts("[data-testid=answer-stats]").pop().unwrap_or_default();
    assert!(footer.starts_with("hip"), "{footer}");
    d.wait("the chat saved", |d| d.texts("[data-testid=composer-target]").concat().starts_with("Asks samples · in “"));
    let chat = d.texts("[data-testid=composer-target]").concat();

    // A restart: the chat shown last is back, and the conversation goes on in it.
    d.quit();
    let d = Driver::start(&base);
    d.wait("the last chat reopened", |d| answers(d).len() == 2);
    assert_eq!(d.texts("[data-testid=composer-target]").concat(), chat);
    let (q, a) = &questions[0];
    ask(&d, q, a);
    assert_eq!(answers(&d).len(), 3);
    let footer = d.texts("[data-testid=answer-stats]").pop().unwrap_or_default();
    assert!(footer.starts_with("hip"), "the chat's method is back after the restart: {footer}");
    screenshot(&display, "new-user-4-after-restart");
    d.quit();
}
