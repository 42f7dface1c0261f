//! Checks every task prompt passes, whichever model and task made it (the demo's tasks in
//! fidelity.rs, the suite's in ruler.rs): it fills its length to within 40 tokens without
//! going over and reads only known words.

use folio_eval::tasks::TaskPrompt;
use folio_models::Engine;

/// Checks `p` against its `length` and returns its documents' and its question's text.
pub fn documents_and_question(engine: &Engine, p: &TaskPrompt, length: usize, at: &str) -> (String, String) {
    let unk = engine.tokenizer.token_id("<|unk|>").unwrap();
    assert!(p.ids.len() <= length && p.ids.len() + 40 >= length, "{at}: {} tokens", p.ids.len());
    assert!(!p.ids.contains(&unk), "{at}: out-of-vocabulary words");
    let (docs, tail) = p.ids.split_at(p.documents_end);
    (engine.tokenizer.decode(docs, false).unwrap(), engine.tokenizer.decode(tail, false).unwrap())
}
