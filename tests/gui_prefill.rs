//! The prefill choice in the real window, as a person meets it: a folder dropped on a fresh
//! Folio, the staging sheet offering a dense and a sparse prefill — each with its memory and
//! its time, the sparse one with what it was measured to cost in answers on the demo model
//! (assets/models/demo/prefill_answers.json, with the answer it loses at 1M) — the sparse one
//! picked with a click and prefilled, the context file recording it, an answer over it saying
//! so under the answer, a sheet adding to it offering the sparse prefill first, and the next
//! new context's sheet timing the sparse prefill by the one just made while dense's time is
//! still to be measured. The app under Xvfb through WebDriver; screenshots are
//! docs/app/prefill-*.png.

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use folio_models::context::{ContextFile, PrefillRun};
use folio_models::prefill::PrefillMode;
use serde_json::json;
use webdriver::{drop_paths, repeated_samples, screenshot, statuses, tauri_driver, Driver, ENTER};
use xvfb::start_xvfb;

/// How often the samples' text is repeated into the dropped document: about 13.8k tokens,
/// mostly past the first sparse query block (3,200 tokens) — a sparse run's cost is kept from
/// 4 × 3,200 computed tokens (`PrefillMode::keeps_fit`) — and over several prefill chunks
/// (2,048 tokens with no memory budget set), so that the run fits a cost the next sheet uses.
const REPEATS: usize = 20;

/// The texts of `css`'s elements as they read on screen (the markup's line breaks as spaces).
fn read(d: &Driver, css: &str) -> Vec<String> {
    d.texts(css).iter().map(|t| t.split_whitespace().collect::<Vec<_>>().join(" ")).collect()
}

fn choices(d: &Driver) -> Vec<String> {
    read(d, "[data-testid=prefill-choice]")
}

#[test]
fn the_staging_sheet_offers_a_sparse_prefill_with_its_time_and_cost_in_answers() {
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let folder = repeated_samples(work.path(), "notes", REPEATS);
    let (_td, base) = tauri_driver(&display, home.path(), "tauri-driver-prefill.log");
    let d = Driver::start(&base);
    d.wait("the window", |d| d.element(".sidebar").is_some());

    // The sheet: dense picked, both priced; the sparse one's cost measured on this model.
    drop_paths(&d, &[&folder]);
    d.wait("the prefill choices", |d| choices(d).len() == 2);
    let [dense, sparse] = <[String; 2]>::try_from(choices(&d)).unwrap();
    assert!(dense.starts_with("Dense") && dense.contains("Time measured on the first dense prefill"), "{dense}");
    assert!(sparse.starts_with("Sparse") && sparse.contains("reads at most 3,200 earlier ones"), "{sparse}");
    assert!(sparse.contains("Time measured on the first sparse prefill"), "{sparse}");
    let cost = read(&d, "[data-testid=prefill-answers]").concat();
    assert!(cost.contains("Measured on this model (H200, 2026-12-02)"), "{cost}");
    assert!(cost.contains("at 128k, 18 of 18 answers right (over a dense prefill 18)"), "{cost}");
    assert!(cost.contains("at 1M, 15 of 18 answers right (over a dense prefill 14)"), "{cost}");
    // At 1M it gets two answers a dense prefill misses and misses one it gets: the loss is said.
    let loses = read(&d, "[data-testid=prefill-loses]").concat();
    assert_eq!(loses, "⚠ It loses answers a dense prefill gets right: 1 of 14 at 1M.");
    let checked = "return document.querySelector('input[name=prefill]:checked').value";
    assert_eq!(d.script(checked, json!([])), json!("dense"));
    screenshot(&display, "prefill-1-choice");

    // Picked with a click on its row, prefilled: the file records the sparse prefill.
    d.click("[data-testid=prefill-choice]:nth-of-type(2)");
    let sparse_mode = PrefillMode::SPARSE.name();
    assert_eq!(d.script(checked, json!([])), json!(sparse_mode));
    d.click("[data-testid=start-prefill]");
    d.wait("notes listed ready", |d| statuses(d) == [("notes".into(), "ready".into())]);
    let file = ContextFile::open(&home.path().join("contexts/notes.folio")).unwrap();
    file.verify().unwrap();
    let tokens = file.tokens().len();
    assert!(tokens > 3200, "{tokens} tokens: the prefill was sparse past the first blocks");
    assert_eq!(file.header().prefill_runs(), [PrefillRun { from: 0, to: tokens, mode: sparse_mode.clone() }]);

    // An answer over it says so under the answer, with the knobs in its tooltip.
    d.click("[data-testid=context] .ctx-button");
    d.wait("the context's documents", |d| d.texts("[data-testid=context-documents] tbody tr").len() == 1);
    d.type_into("#composer-input", &format!("What did Greta write about the river?{ENTER}"));
    d.wait("the answer", |d| !d.texts(".bubble.assistant.done .text").is_empty());
    let footer = d.texts("[data-testid=answer-stats]").pop().unwrap_or_default();
    assert!(footer.contains("over a sparse prefill"), "{footer}");
    let title = d.script("return document.querySelector('[data-testid=answer-stats]').title", json!([]));
    assert!(title.as_str().unwrap_or("").contains(&format!("{sparse_mode} over tokens 0–{tokens}")), "{title}");
    screenshot(&display, "prefill-2-answer");

    // Adding to it offers the prefill its tokens were made with first.
    let extra = work.path().join("extra.md");
    std::fs::write(&extra, "# Extra\n\nThe ferry leaves at nine from the north pier.\n").unwrap();
    d.click("button.attach[title='Add documents to notes']");
    d.wait("the sheet adding to notes", |d| d.texts("#staging-title").concat() == "Add to notes");
    drop_paths(&d, &[&extra]);
    d.wait("the addition's choices", |d| choices(d).len() == 2);
    assert!(choices(&d)[0].starts_with("Sparse"), "{:?}", choices(&d));
    assert_eq!(d.script(checked, json!([])), json!(sparse_mode));
    d.click("[data-testid=staging-sheet] .button.secondary");
    d.wait("the sheet closed", |d| d.element("[data-testid=staging-sheet]").is_none());

    // The next sheet times the sparse prefill by the one just made; dense is still unmeasured.
    drop_paths(&d, &[&folder]);
    d.wait("the sparse prefill's time", |d| {
        choices(d).get(1).is_some_and(|c| c.contains("fitted to the last sparse prefill here"))
    });
    let dense = choices(&d).remove(0);
    assert!(dense.contains("Time measured on the first dense prefill"), "{dense}");
    screenshot(&display, "prefill-3-timed");
    d.quit();
}
