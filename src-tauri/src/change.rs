//! Changing a saved context in place: documents added after its tokens, or one taken out.
//! Shared by `folio prefill --context F --add PATH... | --remove DOC` and the window.
//!
//! Attention is causal, so the K/V of every token before the first changed one stays what a
//! prefill of everything would compute: an addition keeps all the saved tokens and computes
//! only the new documents; a removal keeps the tokens before the removed document and
//! prefills the documents after it again (from their files, checked against the checksums
//! they were prefilled with: the result must be the context made without that document). The
//! new version replaces the file atomically (`context::extend`); an interrupted change leaves
//! the old file as it was, and [`resumed`] rebuilds the same plan from its checkpoint.

use std::ops::ControlFlow;
use std::path::Path;

use anyhow::{bail, Context as _, Result};
use folio_models::context::{
    self, BuildOptions, BuildReport, ContextFile, DocumentSpan, DocumentText, Pending, PrefixPlan, Progress,
};
use folio_models::Engine;

use crate::ingest;

/// What to change in a saved context.
pub(crate) enum Change {
    /// These documents, after its tokens.
    Add(Vec<DocumentText>),
    /// The document with this path or title.
    Remove(String),
}

/// A change's prefill: the new file's plan, of which the first `keep` tokens are the saved
/// context's, K/V as saved.
pub(crate) struct Planned {
    pub plan: PrefixPlan,
    pub keep: usize,
}

impl Planned {
    /// Tokens the change computes.
    pub(crate) fn computed(&self) -> usize {
        self.plan.tokens.len() - self.keep
    }
}

/// The prefill that makes `change` to `base` with `engine` (the model that made it).
pub(crate) fn plan(engine: &Engine, base: &ContextFile, change: &Change) -> Result<Planned> {
    engine.check_context(base)?;
    match change {
        Change::Add(docs) => Ok(Planned { keep: base.tokens().len(), plan: engine.plan_append(base, docs)? }),
        Change::Remove(doc) => {
            let (kept, after) = removal(base, doc)?;
            Ok(Planned { keep: base.tokens_before(kept), plan: engine.plan_keeping(base, kept, &after)? })
        }
    }
}

/// The plan of the interrupted change of `base` into `out` that `pending` (read from `out`'s
/// partial folder) describes — its checkpoint keeps `base_tokens` of the saved tokens: the
/// same documents, read again and checked.
pub(crate) fn resumed(engine: &Engine, base: &ContextFile, out: &Path, pending: &Pending) -> Result<Planned> {
    engine.check_context(base)?;
    let keep = pending.base_tokens;
    let kept = base.documents().iter().take_while(|s| s.start < keep).count();
    let partial = folio_models::context::partial_dir(out);
    if keep == 0 || base.tokens_before(kept) != keep || pending.documents.len() < kept {
        bail!(
            "the interrupted change of {} does not continue this file (it keeps {keep} of its {} tokens): delete {} \
             and make the change again",
            base.path().display(),
            base.tokens().len(),
            partial.display()
        );
    }
    let again: Vec<&DocumentSpan> = pending.documents[kept..].iter().collect();
    let documents = match ingest::reread_saved(&again) {
        Ok(documents) => documents,
        Err(ingest::Reread::Unreadable { path, why }) => bail!(
            "{} cannot be read ({why}): put it back to finish the change of {}, or delete {} to keep the context as \
             it is",
            path.display(),
            base.path().display(),
            partial.display()
        ),
        Err(ingest::Reread::Changed { path }) => bail!(
            "{path} changed since the change of {} started: delete {} and make the change again",
            base.path().display(),
            partial.display()
        ),
    };
    Ok(Planned { keep, plan: engine.plan_keeping(base, kept, &documents)? })
}

/// Prefills `plan` into `out` with `engine`: a new context, or (with `base`) the saved one
/// kept up to `base.keep` and continued. The CLI's prefill and the window's jobs both write
/// through here.
pub(crate) fn write(
    engine: &Engine,
    base: Option<context::Base<'_>>,
    plan: &PrefixPlan,
    out: &Path,
    opts: &BuildOptions,
    on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> folio_models::Result<BuildReport> {
    match base {
        Some(base) => context::extend(&engine.model, engine.stamp()?, base, plan, out, opts, on_progress),
        None => context::build(&engine.model, engine.stamp()?, plan, out, opts, on_progress),
    }
}

/// Taking `doc` (a path or title) out of `base`: how many documents stay as saved, and the
/// documents to prefill again after them, read from disk and checked against the checksums
/// they were prefilled with. Removing the last document re-prefills the one before it (a
/// prefill computes at least one token: the next token comes from the last position).
fn removal(base: &ContextFile, doc: &str) -> Result<(usize, Vec<DocumentText>)> {
    let spans = base.documents();
    let at = spans.iter().position(|s| s.path == doc || s.title == doc).with_context(|| {
        let names: Vec<&str> = spans.iter().map(|s| s.path.as_str()).collect();
        format!("no document \"{doc}\" in {}: its documents are {}", base.path().display(), names.join(", "))
    })?;
    if spans.len() == 1 {
        bail!("{doc} is the only document of {}: delete the context instead", base.path().display());
    }
    let kept = if at + 1 == spans.len() { at - 1 } else { at };
    let again: Vec<_> = spans[kept..].iter().enumerate().filter(|(i, _)| kept + i != at).map(|(_, s)| s).collect();
    match ingest::reread_saved(&again) {
        Ok(documents) => Ok((kept, documents)),
        Err(ingest::Reread::Unreadable { path, why }) => bail!(
            "{} is prefilled again after the removed document but cannot be read ({why}); put it back, or prefill \
             the documents again",
            path.display()
        ),
        Err(ingest::Reread::Changed { path }) => {
            bail!("{path} changed since it was prefilled; prefill the documents again (or --add its new version)")
        }
    }
}

#[cfg(test)]
mod tests {
    use folio_models::context::KvDtype;

    use super::*;

    fn demo() -> Engine {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap()
    }

    fn documents(paths: &[&Path]) -> Vec<DocumentText> {
        let paths: Vec<_> = paths.iter().map(|p| p.to_path_buf()).collect();
        ingest::collect(&paths).unwrap().documents
    }

    /// An addition stopped after its first layer is finished from its checkpoint alone: the
    /// resumed plan is the one the addition started with, and the finished file is the context
    /// prefilled with every document in one go (f32: the same bytes of K/V). A document changed
    /// since refuses the resume, naming it and the way out.
    #[test]
    fn an_interrupted_addition_resumes_from_its_checkpoint() {
        let e = demo();
        let dir = tempfile::tempdir().unwrap();
        let samples = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples"));
        let added = dir.path().join("added.md");
        std::fs::write(&added, "# Added\n\nThe ferry leaves at nine from the north pier.\n").unwrap();
        let (first, second) = (samples.join("field_notes.txt"), samples.join("market_records.txt"));
        let opts = BuildOptions { kv_dtype: KvDtype::F32, memory_budget: None, restart: false, hidden_in: None };
        let stamp = e.stamp().unwrap();
        let out = dir.path().join("ctx.folio");
        let plan = e.plan_context(&documents(&[&first, &second]), None, None).unwrap();
        context::build(&e.model, stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(())).unwrap();

        let extend =
            |base: &ContextFile, planned: &Planned, on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>| {
                let keep = context::Base { file: base, keep: planned.keep };
                context::extend(&e.model, stamp, keep, &planned.plan, &out, &opts, on_progress)
            };
        let base = ContextFile::open(&out).unwrap();
        let started = super::plan(&e, &base, &Change::Add(documents(&[&added]))).unwrap();
        let stop_after_a_layer = &mut |p: &Progress| match p.layer {
            0 => ControlFlow::Continue(()),
            _ => ControlFlow::Break(()),
        };
        let stopped = extend(&base, &started, stop_after_a_layer);
        assert!(stopped.is_err(), "the addition stopped");
        let pending = context::pending(&out).unwrap().expect("its checkpoint");
        assert_eq!(pending.base_tokens, base.tokens().len());

        let base = ContextFile::open(&out).unwrap();
        assert_eq!(base.documents().len(), 2, "the file is as it was");
        let again = resumed(&e, &base, &out, &pending).unwrap();
        assert_eq!((again.plan.tokens.clone(), again.keep), (started.plan.tokens.clone(), started.keep));
        let go = &mut |_: &Progress| ControlFlow::Continue(());
        let report = extend(&base, &again, go).unwrap();
        assert!(report.resumed_layers >= 1, "{report:?}");

        let whole = dir.path().join("whole.folio");
        let plan = e.plan_context(&documents(&[&first, &second, &added]), None, None).unwrap();
        context::build(&e.model, stamp, &plan, &whole, &opts, go).unwrap();
        let (grown, whole) = (ContextFile::open(&out).unwrap(), ContextFile::open(&whole).unwrap());
        grown.verify().unwrap();
        assert_eq!(grown.tokens(), whole.tokens());
        assert_eq!(grown.documents(), whole.documents());
        for layer in 0..e.config().num_layers {
            assert_eq!(grown.layer_kv(layer).unwrap(), whole.layer_kv(layer).unwrap(), "layer {layer}");
        }

        // Stopped again, then a document edited: the resume is refused, the file kept.
        let base = ContextFile::open(&out).unwrap();
        let more = dir.path().join("more.md");
        std::fs::write(&more, "More notes.\n").unwrap();
        let started = super::plan(&e, &base, &Change::Add(documents(&[&more]))).unwrap();
        let _ = extend(&base, &started, stop_after_a_layer);
        std::fs::write(&more, "Edited since.\n").unwrap();
        let pending = context::pending(&out).unwrap().expect("its checkpoint");
        let err = resumed(&e, &ContextFile::open(&out).unwrap(), &out, &pending).err().unwrap().to_string();
        assert!(err.contains("more.md changed since the change") && err.contains("delete"), "{err}");
    }
}
