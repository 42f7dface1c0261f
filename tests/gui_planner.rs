//! The memory planner's three tiers in the real window (issue #47): with offload on and a host
//! budget below the open context's K/V (and above the app and the least the file tier needs),
//! Settings → Memory plans part of the K/V in host memory and the rest read from the context
//! file, and counts the disk's bytes in a step at the rate measured on this machine; the chat
//! then answers over that context with the rows on the file tier. The app under Xvfb through
//! WebDriver, as a person drops, opens and sets.

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use std::time::{Duration, Instant};

use serde_json::json;
use webdriver::{choose_method, drop_paths, open_settings, screenshot, statuses, Driver, ENTER};
use xvfb::start_xvfb;

/// Times a host budget is set from the plan's figures before the test gives up: the app's
/// memory moves a little between a plan and the next, and the budget sits half the K/V (about
/// 6 MiB here) from either side.
const TRIES: usize = 3;

/// How long one try waits for the plan to move to the file tier.
const TRY_WAIT: Duration = Duration::from_secs(20);

/// "12.3 MiB" → bytes, as the window's `bytes` prints them.
fn shown(text: &str) -> f64 {
    let mut parts = text.split_whitespace();
    let value: f64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
    let unit = parts.next().unwrap_or_default();
    match ["B", "KiB", "MiB", "GiB"].iter().position(|u| *u == unit) {
        Some(power) => value * 1024f64.powi(power as i32),
        None => f64::NAN,
    }
}

/// The planner's figure in the row `testid`.
fn plan_row(d: &Driver, testid: &str) -> String {
    d.texts(&format!("[data-testid={testid}] dd")).concat()
}

/// Sets a field of the engine form as typing does, and applies the form.
fn apply_engine(d: &Driver, field: &str, value: &str) {
    d.script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1]; \
         e.dispatchEvent(new Event('input', {bubbles: true})); e.dispatchEvent(new Event('change', {bubbles: true})); \
         document.querySelector('[data-testid=apply-engine]').click();",
        json!([field, value]),
    );
}

/// Whether the plan keeps part of the K/V on disk and counts the disk in a step.
fn on_the_file_tier(d: &Driver) -> bool {
    let terms = d.texts("[data-testid=memory-plan] .terms li").concat();
    plan_row(d, "plan-kv-host").contains("the rest read from the file") && terms.contains("disk (")
}

#[test]
fn a_context_past_the_host_budget_is_planned_on_the_file_tier() {
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    // About 12k tokens: 12 MiB of K/V on the demo model (1 KiB a token).
    let notes = webdriver::repeated_samples(work.path(), "long notes", 18);
    let (_td, base) = webdriver::tauri_driver(&display, home.path(), "tauri-driver-planner.log");
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    drop_paths(&d, &[&notes]);
    d.wait("one staged document", |d| d.texts("[data-testid=staged-documents] tbody tr").len() == 1);
    d.click("[data-testid=start-prefill]");
    d.wait("long notes ready", |d| statuses(d) == [("long notes".into(), "ready".into())]);
    d.click("[data-testid=context] .ctx-button");
    d.wait("the open button", |d| d.element("[data-testid=open-context]").is_some());
    d.click("[data-testid=open-context]");
    d.wait("the chat over long notes", |d| d.texts("[data-testid=open-context-chip]").concat().contains("long notes"));
    choose_method(&d, "dense");
    open_settings(&d);
    d.script("document.querySelector('[data-testid=offload]').click()", json!([]));
    d.script("document.querySelector('[data-testid=apply-engine]').click()", json!([]));
    d.wait("the K/V in host memory", |d| plan_row(d, "plan-kv-host").contains(" MiB") && !on_the_file_tier(d));
    let mut tried = Vec::new();
    for _ in 0..TRIES {
        let kv = shown(&plan_row(&d, "plan-kv-host"));
        let host = plan_row(&d, "plan-host");
        let app = shown(host.split("the app ").nth(1).unwrap_or(""));
        assert!(kv > 0.0 && app > 0.0, "the plan shows the K/V ({kv}) and the app ({app}): {host}");
        let budget = format!("{}KiB", ((app + kv / 2.0) / 1024.0) as u64);
        apply_engine(&d, "[data-testid=host-budget]", &budget);
        let deadline = Instant::now() + TRY_WAIT;
        while Instant::now() < deadline && !on_the_file_tier(&d) {
            std::thread::sleep(Duration::from_millis(200));
        }
        tried.push((budget, d.texts("[data-testid=memory-plan]").concat()));
        if on_the_file_tier(&d) {
            break;
        }
    }
    let plan = d.texts("[data-testid=memory-plan]").concat();
    assert!(on_the_file_tier(&d), "the plan never moved to the file tier: {tried:?}");
    println!("budgets tried: {:?}\nthe plan: {plan}", tried.iter().map(|t| &t.0).collect::<Vec<_>>());
    let disk = d.texts("[data-testid=memory-plan] .terms li").into_iter().find(|t| t.starts_with("disk (")).unwrap();
    assert!(disk.contains(" GB/s = "), "the disk's bytes at its measured rate: {disk}");
    assert!(d.texts("[data-testid=plan-problem]").is_empty(), "{plan}");
    d.script("document.querySelector('[data-testid=memory-plan]').scrollIntoView()", json!([]));
    std::thread::sleep(Duration::from_millis(300));
    screenshot(&display, "16c-file-tier");
    // The chat answers over the context with its rows on the file tier.
    d.click("[aria-label='Close settings']");
    d.type_into("#composer-input", &format!("what is the secret code of amber falcon ?{ENTER}"));
    d.wait("an answer", |d| d.texts(".bubble.assistant.done .text").first().is_some_and(|t| !t.is_empty()));
    println!("answered from the file tier: {:?}", d.texts(".bubble.assistant.done .text"));
    assert!(d.texts(".bubble.error, [role=alert]").concat().is_empty(), "{:?}", d.texts("body"));
    d.quit();
}
