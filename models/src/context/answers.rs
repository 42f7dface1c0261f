//! What a prefill costs in answers, as measured on a model: the rows `folio eval fidelity
//! --prefill sparse` measures (the same prompts answered over a sparse and over a dense
//! prefill, both decoded densely), kept in a file beside the model so that the staging sheet can
//! put the cost next to the time a sparse prefill saves.
//!
//! Why a file and not a table in the code: the cost is the model's — a sparse prefill changes
//! every layer's K/V after the first, and what that does to answers depends on how the model
//! reads them — and it comes from a run anyone can repeat, which each row names. The project
//! ships the demo model's (`assets/models/demo`); `folio eval prefill-cost --into` writes one
//! for another model, into Folio's kept folder (where calibrations go) when the model's folder
//! is read-only. Rows are tied to the model's fingerprint: a file left beside other weights is
//! not read as theirs.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::Engine;

/// The file's name in a model's folder (or its kept folder).
pub const ANSWERS_FILE: &str = "prefill_answers.json";
/// The file's version; a newer one is refused rather than misread.
const VERSION: u32 = 1;

/// One measured cost: a prefill's answers against a dense prefill's at one context length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct AnswerCost {
    /// The prefill measured (`sparse:` and every knob), as the context file records it.
    pub prefill: String,
    /// The prompts' length in tokens.
    pub length: usize,
    pub prompts: usize,
    /// Prompts answered right over this prefill (decoded densely).
    pub answered: usize,
    /// The same prompts answered right over a dense prefill (decoded densely).
    pub dense_answered: usize,
    /// Of those, the prompts this prefill got wrong: what it loses, which a count of right
    /// answers can hide (one lost and two gained read as one more right).
    #[serde(default)]
    pub lost: usize,
    /// Mean KL(dense prefill ‖ this prefill) of the next-token distributions over the dense
    /// prefill's answer (nats), and the share of those steps whose top token is the same.
    pub mean_kl: f64,
    pub top1_agreement: f64,
    /// The run, as `--measured` named it ("H200, 2026-12-02").
    pub measured: String,
}

impl AnswerCost {
    /// Some prompt a dense prefill answers right is answered wrong over this one.
    pub fn loses_answers(&self) -> bool {
        self.lost > 0
    }
}

#[derive(Serialize, Deserialize)]
struct AnswersFile {
    version: u32,
    /// [`Engine::fingerprint_id`] of the model measured.
    model: String,
    rows: Vec<AnswerCost>,
}

/// The rows in `dir`'s file measured on model `model` (none without a file, or with one for
/// another model); a file that does not read is an error naming it.
pub fn read(dir: &Path, model: &str) -> Result<Vec<AnswerCost>> {
    let path = dir.join(ANSWERS_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Invalid(format!("{}: {e}", path.display()))),
    };
    let file: AnswersFile = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Invalid(format!("{} does not read as measured answer costs: {e}", path.display())))?;
    if file.version > VERSION {
        return Err(Error::Invalid(format!(
            "{} is version {} of the answer costs; this Folio reads up to {VERSION}: update Folio",
            path.display(),
            file.version
        )));
    }
    Ok(if file.model == model { file.rows } else { Vec::new() })
}

/// Adds `rows` to `dir`'s file for model `model` (atomically), replacing rows of the same
/// prefill and length; a file for another model is replaced.
pub fn record(dir: &Path, model: &str, rows: &[AnswerCost]) -> Result<()> {
    let mut kept = read(dir, model)?;
    kept.retain(|k| !rows.iter().any(|r| r.prefill == k.prefill && r.length == k.length));
    kept.extend(rows.iter().cloned());
    kept.sort_by(|a, b| a.prefill.cmp(&b.prefill).then(a.length.cmp(&b.length)));
    let file = AnswersFile { version: VERSION, model: model.to_owned(), rows: kept };
    let json = serde_json::to_vec_pretty(&file).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::create_dir_all(dir).map_err(|e| Error::Invalid(format!("{}: {e}", dir.display())))?;
    folio_context_file::atomic::write_atomic(&dir.join(ANSWERS_FILE), &json).map_err(Error::from)
}

/// What prefill `prefill` was measured to cost on `engine`'s model, by context length: the
/// kept folder's rows over the model folder's (a run here over the shipped one).
pub fn measured(engine: &Engine, prefill: &str) -> Result<Vec<AnswerCost>> {
    let model = engine.fingerprint_id()?;
    let own = read(engine.model_dir(), &model)?;
    let kept_dir = engine.calibration_dir()?;
    let kept = if kept_dir == engine.model_dir() { Vec::new() } else { read(&kept_dir, &model)? };
    let mut rows: Vec<AnswerCost> =
        own.into_iter().filter(|o| !kept.iter().any(|k| k.prefill == o.prefill && k.length == o.length)).collect();
    rows.extend(kept);
    rows.retain(|r| r.prefill == prefill);
    rows.sort_by_key(|r| r.length);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(prefill: &str, length: usize, answered: usize) -> AnswerCost {
        AnswerCost {
            prefill: prefill.into(),
            length,
            prompts: 9,
            answered,
            dense_answered: 9,
            lost: 9 - answered,
            mean_kl: 0.01,
            top1_agreement: 0.99,
            measured: "test".into(),
        }
    }

    /// Recording merges by (prefill, length), reading is per model, and a newer file or one
    /// that is not JSON is an error naming it, never an empty table.
    #[test]
    fn recorded_rows_merge_per_model_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path(), "m1").unwrap().is_empty());
        record(dir.path(), "m1", &[row("sparse:a", 131072, 9), row("sparse:a", 32768, 9)]).unwrap();
        record(dir.path(), "m1", &[row("sparse:a", 131072, 7)]).unwrap();
        let rows = read(dir.path(), "m1").unwrap();
        assert_eq!(rows.iter().map(|r| (r.length, r.answered)).collect::<Vec<_>>(), [(32768, 9), (131072, 7)]);
        assert!(rows[1].loses_answers() && !rows[0].loses_answers());
        assert!(read(dir.path(), "m2").unwrap().is_empty(), "another model's rows are not read");
        let path = dir.path().join(ANSWERS_FILE);
        std::fs::write(&path, br#"{"version": 2, "model": "m1", "rows": []}"#).unwrap();
        assert!(read(dir.path(), "m1").unwrap_err().to_string().contains("update Folio"));
        std::fs::write(&path, b"not json").unwrap();
        assert!(read(dir.path(), "m1").unwrap_err().to_string().contains(ANSWERS_FILE));
    }
}
