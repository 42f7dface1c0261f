//! The fidelity report (issue #21): how far each attention method's *answers* are from dense
//! attention's on prompts whose answers read the documents while they are generated
//! ([`crate::tasks`]).
//!
//! Per prompt, dense attention answers first (greedy); its answer is the reference. Each method
//! then (1) answers the same prompt itself — exact accuracy, time to the first token, time per
//! token — and (2) is teacher-forced on dense's answer, which gives its next-token KL from
//! dense and top-1 agreement with dense over the span the model generates (the same tokens
//! for every method, so the figures compare), and the rows it read ([`ReadTally`]). Timing
//! comes from (1), which runs the method alone; the tally's copies of the picks stay in (2).
//!
//! The question before the answer is attended as [`QuestionMode`] says: densely (the papers'
//! prefill, Folio's default) or with the method, one token at a time — the "sparse question"
//! mode, whose first answer token at 1M tokens no longer waits for a dense pass over every row.
//! The reference is always fully dense.
//!
//! On the offloaded tier the documents are prefilled once per prompt and every run (each
//! method, each question mode) starts from them; on the resident tier every run prefills the
//! whole prompt (BUZZ's cache is built from it).
//!
//! Two things to read the figures with: with a dense question the first answer token's
//! distribution comes from the dense multi-token pass for every method but BUZZ, so that step
//! agrees with dense by construction (a 7-token answer has 6 steps the method decides); and a
//! method whose picks can tie (Double Sparsity's 4-bit labels) may break ties differently in its
//! own run and in the teacher-forced one, so its accuracy and its top-1 agreement can disagree
//! on a GPU.

use std::ops::ControlFlow;

use serde::{Deserialize, Serialize};

use crate::needle::{PromptStore, PromptTier, EXTRA_ANSWER_TOKENS};
use crate::tasks::{Task, TaskPrompt};
use folio_models::attention::ReadTally;
use folio_models::attention::{Attention, Dense};
use folio_models::context::answers::AnswerCost;
use folio_models::distribution::{argmax, kl_divergence};
use folio_models::error::Result;
use folio_models::generate::{self, GenerateParams, Generation, SamplingParams};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;

/// How the question (the prompt after the documents) is attended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuestionMode {
    /// In one multi-token pass, densely for every method but BUZZ.
    Dense,
    /// One token at a time with the method (each a decode step).
    Sparse,
}

impl QuestionMode {
    pub fn name(self) -> &'static str {
        match self {
            QuestionMode::Dense => "dense",
            QuestionMode::Sparse => "sparse",
        }
    }
}

/// Where a prompt's (task, length, depth, sample) cell is.
#[derive(Debug, Clone, Copy)]
pub struct Cell {
    pub task: Task,
    pub length: usize,
    pub depth: f64,
    pub sample: usize,
}

/// One method's answer to one prompt, against dense's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub task: Task,
    pub length: usize,
    pub depth: f64,
    pub sample: usize,
    pub question: QuestionMode,
    pub prompt_tokens: usize,
    pub expected: String,
    pub output: String,
    /// The generated tokens begin with the expected answer's.
    pub correct: bool,
    /// Of the answer's `values`, how many the output has at their place.
    pub values_right: usize,
    pub values: usize,
    /// Dense's answer (the teacher-forced span) and whether it was right.
    pub dense_output: String,
    pub dense_correct: bool,
    /// From the question to the first answer token (on the resident tier the whole prompt's
    /// pass is included).
    pub first_token_s: Option<f64>,
    /// Mean time of the decode steps after the first token.
    pub ms_per_token: Option<f64>,
    /// Teacher-forced on dense's answer: mean and largest KL(dense ‖ method) of the next-token
    /// distributions (nats), and the share of steps whose top token is dense's.
    pub mean_kl: f64,
    pub max_kl: f64,
    pub top1_agreement: f64,
    pub forced_steps: usize,
    /// Rows read per query head and decode call over the teacher-forced steps (the question's
    /// too, when it is read one token at a time), and their share of the rows those calls saw.
    pub rows_read: f64,
    pub rows_read_fraction: f64,
    /// The documents' prefill on the offloaded tier, shared by the methods (0 on the resident).
    pub prefill_seconds: f64,
    /// How the documents the method decoded over were prefilled (`dense`, or `sparse:` and its
    /// knobs); the reference's always densely. Absent in reports from before it: dense.
    #[serde(default = "dense_prefill")]
    pub prefill: String,
}

fn dense_prefill() -> String {
    PrefillMode::Dense.name()
}

/// Runs `prompt` with dense attention, then with each of `attns` for each of `questions`:
/// `out[q][m]` is method `m`'s outcome with question mode `questions[q]`. The documents are
/// prefilled (offloaded tier) and dense's reference computed once for all of them; with a
/// sparse `prefill` the methods decode over a second prefill of the documents, that one's,
/// and are measured against the dense prefill's dense answer.
#[allow(clippy::too_many_arguments)]
pub fn run_prompt(
    engine: &Engine,
    prompt: &TaskPrompt,
    cell: Cell,
    attns: &[&dyn Attention],
    tier: &PromptTier,
    questions: &[QuestionMode],
    prefill: PrefillMode,
) -> Result<Vec<Vec<Outcome>>> {
    let (mut reference_store, dense_seconds) =
        PromptStore::new(engine, &prompt.ids, prompt.documents_end, (tier, PrefillMode::Dense))?;
    let params = |pass| GenerateParams {
        max_new_tokens: prompt.expected_ids.len() + EXTRA_ANSWER_TOKENS,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_token_ids: engine.eos_token_ids(),
        prompt_pass: pass,
    };
    let quiet = |_: &str| ControlFlow::Continue(());
    let steps = |_, _| ControlFlow::Continue(());
    let (model, tokenizer) = (&engine.model, &engine.tokenizer);

    let dense = reference_store
        .run(false, |kv, input, pass| generate::generate(model, tokenizer, &Dense, kv, input, &params(pass), quiet))?;
    let answer = &dense.tokens;
    let reference = reference_store
        .run(false, |kv, input, pass| generate::teacher_forced(model, &Dense, kv, input, answer, pass, steps))?;
    let (mut store, prefill_seconds) = match prefill {
        PrefillMode::Dense => (reference_store, dense_seconds),
        sparse => {
            drop(reference_store);
            PromptStore::new(engine, &prompt.ids, prompt.documents_end, (tier, sparse))?
        }
    };
    let q_heads = engine.config().num_heads as f64;
    let mut one = |attn: &dyn Attention, question: QuestionMode| -> Result<Outcome> {
        let sparse = question == QuestionMode::Sparse;
        let own: Generation = store.run(sparse, |kv, input, pass| {
            generate::generate(model, tokenizer, attn, kv, input, &params(pass), quiet)
        })?;
        attn.end_conversation();
        // Only the totals are read: the documents' span is the one the app's tally would use.
        let tally = ReadTally::new(attn, vec![(0, prompt.documents_end)]);
        let forced = store
            .run(sparse, |kv, input, pass| generate::teacher_forced(model, &tally, kv, input, answer, pass, steps))?;
        attn.end_conversation();
        let kls: Vec<f64> = reference.iter().zip(&forced).map(|(p, q)| kl_divergence(p, q)).collect();
        let agree = reference.iter().zip(&forced).filter(|(p, q)| argmax(p) == argmax(q)).count();
        let reads = tally.summary();
        let decoded = own.tokens.len().saturating_sub(1);
        Ok(Outcome {
            task: cell.task,
            length: cell.length,
            depth: cell.depth,
            sample: cell.sample,
            question,
            prompt_tokens: prompt.ids.len(),
            expected: prompt.expected.clone(),
            correct: prompt.correct(&own.tokens),
            values_right: prompt.values_right(&own.text),
            values: prompt.values.len(),
            output: own.text,
            dense_output: dense.text.clone(),
            dense_correct: prompt.correct(&dense.tokens),
            first_token_s: own.first_token_s,
            ms_per_token: own
                .first_token_s
                .filter(|_| decoded > 0)
                .map(|first| 1e3 * (own.seconds - first) / decoded as f64),
            mean_kl: kls.iter().sum::<f64>() / kls.len().max(1) as f64,
            max_kl: kls.iter().copied().fold(0.0, f64::max),
            top1_agreement: agree as f64 / kls.len().max(1) as f64,
            forced_steps: kls.len(),
            rows_read: reads.total_rows / (reads.calls as f64 * q_heads).max(1.0),
            rows_read_fraction: reads.total_rows / reads.visible_rows.max(1.0),
            prefill_seconds,
            prefill: prefill.name(),
        })
    };
    questions.iter().map(|&q| attns.iter().map(|&attn| one(attn, q)).collect()).collect()
}

/// What a sparse prefill cost in answers, per context length, from dense attention's outcomes
/// over it (the method that isolates the prefill: its reference is the dense prefill's dense
/// answer on the same prompt): right answers over each prefill, the prompts it lost, and the
/// means of the prompts' KL and top-1 agreement (as the report's summaries take them). Outcomes over a dense
/// prefill, and those with a sparse question, are left out; `measured` names the run.
pub fn answer_costs(dense_outcomes: &[Outcome], measured: &str) -> Vec<AnswerCost> {
    let over_sparse: Vec<&Outcome> = dense_outcomes
        .iter()
        .filter(|o| o.question == QuestionMode::Dense && o.prefill != PrefillMode::Dense.name())
        .collect();
    let mut keys: Vec<(String, usize)> = over_sparse.iter().map(|o| (o.prefill.clone(), o.length)).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(prefill, length)| {
            let mine: Vec<&&Outcome> =
                over_sparse.iter().filter(|o| o.prefill == prefill && o.length == length).collect();
            let n = mine.len();
            let mean = |f: &dyn Fn(&Outcome) -> f64| mine.iter().map(|o| f(o)).sum::<f64>() / n as f64;
            AnswerCost {
                length,
                prompts: n,
                answered: mine.iter().filter(|o| o.correct).count(),
                dense_answered: mine.iter().filter(|o| o.dense_correct).count(),
                lost: mine.iter().filter(|o| o.dense_correct && !o.correct).count(),
                mean_kl: mean(&|o| o.mean_kl),
                top1_agreement: mean(&|o| o.top1_agreement),
                measured: measured.to_owned(),
                prefill,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(prefill: &str, length: usize, correct: bool, dense_correct: bool, kl: f64) -> Outcome {
        Outcome {
            task: Task::Needle,
            length,
            depth: 0.5,
            sample: 0,
            question: QuestionMode::Dense,
            prompt_tokens: length,
            expected: "1".into(),
            output: "1".into(),
            correct,
            values_right: 0,
            values: 1,
            dense_output: "1".into(),
            dense_correct,
            first_token_s: None,
            ms_per_token: None,
            mean_kl: kl,
            max_kl: kl,
            top1_agreement: 1.0 - kl,
            forced_steps: 3,
            rows_read: 0.0,
            rows_read_fraction: 1.0,
            prefill_seconds: 0.0,
            prefill: prefill.into(),
        }
    }

    /// Per (prefill, length): right answers over each prefill, the ones lost, and the prompts'
    /// mean KL; a dense prefill's outcomes are not a cost.
    #[test]
    fn answer_costs_group_by_prefill_and_length() {
        let outcomes = [
            outcome("sparse:x", 1024, true, true, 0.1),
            outcome("sparse:x", 1024, false, true, 0.3),
            outcome("sparse:x", 4096, true, false, 0.0),
            outcome("sparse:x", 4096, true, false, 0.0),
            outcome("sparse:x", 4096, false, true, 0.0),
            outcome("dense", 1024, true, true, 0.0),
        ];
        let rows = answer_costs(&outcomes, "here");
        assert_eq!(rows.len(), 2);
        let r = &rows[0];
        assert_eq!((r.length, r.prompts, r.answered, r.dense_answered, r.lost), (1024, 2, 1, 2, 1));
        assert!((r.mean_kl - 0.2).abs() < 1e-12 && r.loses_answers() && r.measured == "here");
        // Two gained and one lost: more right answers, and still a loss.
        let r = &rows[1];
        assert_eq!((r.length, r.answered, r.dense_answered, r.lost), (4096, 2, 1, 1));
        assert!(r.loses_answers());
    }
}
