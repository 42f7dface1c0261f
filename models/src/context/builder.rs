//! The one call that makes or changes a context file: [`Builder`] takes a [`Change`] — a new
//! context, documents added, a document taken out, or the resume of an interrupted one — over
//! documents the caller has already read, plans it, and prefills it with checkpoints and an
//! atomic write, telling the caller's [`Bookkeeping`] (the library) when the context appears
//! and when it is done. `folio prefill` and the window's prefill jobs are both a short call of
//! it, so the two cannot drift apart in what they keep, recompute or refuse.
//!
//! Why a change keeps what it keeps: attention is causal, so the K/V of every token before the
//! first changed one stays what a prefill of everything would compute. An addition keeps all
//! the saved tokens and computes only the new documents; a removal keeps the tokens before the
//! removed document and prefills the documents after it again — read from their files by the
//! caller's [`SavedDocuments`] and checked against the checksums they were prefilled with, so
//! the result is the context made without that document. The new version replaces the file
//! atomically; an interrupted change leaves the old file as it was, and [`Change::Resume`]
//! rebuilds the same plan from its checkpoint alone.
//!
//! Why the engine does not read files itself: reading documents (PDF, DOCX, encodings, limits)
//! is the `folio-ingest` crate's job, which the engine does not depend on; the product hands
//! the engine text, and a reader for the saved documents a removal or resume reads again.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use folio_context_file::atomic::check_replaceable;
use folio_context_file::{partial_dir, pending, pending_date, ContextFile, DocumentSpan, KvDtype, Pending};

use super::build::{extend, Base};
use super::prompt::{DocumentText, PrefixPlan};
use super::{BuildOptions, BuildReport, Progress};
use crate::error::{Error, Result};
use crate::prefill::PrefillMode;
use crate::Engine;

/// How contexts store K/V unless told otherwise (the window's, and `folio prefill`'s default).
pub const DEFAULT_KV_DTYPE: KvDtype = KvDtype::Bf16;

/// What to make of a context file.
#[derive(Debug, Clone)]
pub enum Change {
    /// A new context of these documents, after an optional system message.
    New { documents: Vec<DocumentText>, system: Option<String> },
    /// These documents, after the saved context's tokens.
    Add(Vec<DocumentText>),
    /// The document with this path or title taken out.
    Remove(String),
    /// The interrupted prefill or change of the file, from its partial folder.
    Resume,
}

/// Why a document saved in a context cannot be read again as it was prefilled.
#[derive(Debug, Clone)]
pub enum Reread {
    /// It is gone or does not read.
    Unreadable { path: PathBuf, why: String },
    /// Its text is not the one it was prefilled from.
    Changed { path: String },
}

/// The caller's reader of documents saved in a context: each span's file read again and
/// checked against the checksum it was prefilled with (`DocumentSpan::xxh3`).
pub trait SavedDocuments {
    fn reread(&self, spans: &[&DocumentSpan]) -> std::result::Result<Vec<DocumentText>, Reread>;
}

/// What the library does around a prefill; both hooks are told, never asked.
pub trait Bookkeeping {
    /// The prefill's first checkpoint exists: the context can be listed (as prefilling).
    fn started(&mut self, out: &Path);
    /// The prefill ended: with its report when it finished, `None` when it failed or stopped.
    fn finished(&mut self, out: &Path, report: Option<&BuildReport>);
}

/// No bookkeeping (tests, `--no-library`).
impl Bookkeeping for () {
    fn started(&mut self, _: &Path) {}
    fn finished(&mut self, _: &Path, _: Option<&BuildReport>) {}
}

/// A change planned: the new file's tokens, of which the first `keep` are the saved
/// context's, K/V as saved.
pub struct Planned {
    pub plan: PrefixPlan,
    pub keep: usize,
    base: Option<ContextFile>,
    /// The K/V dtype the saved file or the interrupted prefill already has.
    saved_kv_dtype: Option<KvDtype>,
    /// How the interrupted prefill a resume finishes attends (its computed tokens' run).
    saved_prefill: Option<PrefillMode>,
}

impl Planned {
    /// Tokens the prefill computes.
    pub fn computed(&self) -> usize {
        self.plan.tokens.len() - self.keep
    }

    /// The saved context the change continues (`None` for a new one).
    pub fn base(&self) -> Option<&ContextFile> {
        self.base.as_ref()
    }

    /// The K/V dtype the saved file or the interrupted prefill already has (`None` for a new
    /// context).
    pub fn saved_kv_dtype(&self) -> Option<KvDtype> {
        self.saved_kv_dtype
    }

    /// The dtype to store K/V as: `explicit` when the user named one, else the one the saved
    /// file or the interrupted prefill has, else `default`.
    pub fn kv_dtype(&self, explicit: Option<KvDtype>, default: KvDtype) -> KvDtype {
        explicit.or(self.saved_kv_dtype).unwrap_or(default)
    }

    /// How the computed tokens attend: `explicit` when the user named a mode, else the
    /// interrupted prefill's when this resumes one, else dense.
    pub fn prefill(&self, explicit: Option<PrefillMode>) -> PrefillMode {
        explicit.or(self.saved_prefill).unwrap_or_default()
    }
}

/// The prefill mode of an interrupted prefill's computed tokens (its header's last run).
fn pending_prefill(pending: &Pending) -> Result<PrefillMode> {
    let runs = pending.header.prefill_runs();
    let mode = runs.last().map_or(folio_context_file::DENSE_PREFILL, |r| r.mode.as_str());
    PrefillMode::parse(mode).map_err(|e| {
        Error::Invalid(format!(
            "the interrupted prefill was made with `--prefill {mode}`, which this Folio does not read: {e}"
        ))
    })
}

/// Makes or changes the context file `out` with one engine. See the module docs.
pub struct Builder<'a> {
    engine: &'a Engine,
    out: PathBuf,
    /// The saved context a change starts from, when it is not `out` itself.
    base: Option<PathBuf>,
    restart: bool,
}

impl<'a> Builder<'a> {
    pub fn new(engine: &'a Engine, out: impl Into<PathBuf>) -> Self {
        Self { engine, out: out.into(), base: None, restart: false }
    }

    /// Change the saved context at `base` and write the result to the output (by default a
    /// change replaces the file it changes).
    pub fn from(mut self, base: impl Into<PathBuf>) -> Self {
        self.base = Some(base.into());
        self
    }

    /// Start over: a new context's prompt is rendered with today's date (not the interrupted
    /// prefill's), and [`Self::run`] discards an interrupted prefill of the output that does not
    /// match this one instead of refusing (as `BuildOptions::restart`).
    pub fn restart(mut self, restart: bool) -> Self {
        self.restart = restart;
        self
    }

    /// Plans `change`: which tokens the new file has, which of them are kept as saved. Reads
    /// the saved file's headers and, for a removal or resume, the documents `saved` reads
    /// again; computes nothing.
    pub fn plan(&self, change: Change, saved: &dyn SavedDocuments) -> Result<Planned> {
        // Before anything opens it: opening a named pipe would wait for a writer forever.
        check_replaceable(&self.out)?;
        let engine = self.engine;
        match change {
            Change::New { documents, system } => {
                let date = if self.restart { None } else { pending_date(&self.out) };
                let plan = engine.plan_context(&documents, system.as_deref(), date)?;
                Ok(Planned { plan, keep: 0, base: None, saved_kv_dtype: None, saved_prefill: None })
            }
            Change::Add(documents) => {
                let base = self.open_base()?;
                let plan = engine.plan_append(&base, &documents)?;
                Ok(Planned {
                    keep: base.tokens().len(),
                    plan,
                    saved_kv_dtype: Some(base.header().kv_dtype),
                    saved_prefill: None,
                    base: Some(base),
                })
            }
            Change::Remove(doc) => {
                let base = self.open_base()?;
                let (kept, after) = removal(&base, &doc, saved)?;
                let plan = engine.plan_keeping(&base, kept, &after)?;
                let keep = base.tokens_before(kept);
                let saved_kv_dtype = Some(base.header().kv_dtype);
                Ok(Planned { keep, plan, saved_kv_dtype, saved_prefill: None, base: Some(base) })
            }
            Change::Resume => {
                let pending = pending(&self.out)?.ok_or_else(|| {
                    Error::Invalid(format!("{} has no interrupted prefill to resume", self.out.display()))
                })?;
                match pending.base_tokens {
                    0 => self.resumed_new(&pending, saved),
                    _ => self.resumed_change(&pending, saved),
                }
            }
        }
    }

    /// Prefills `planned` into the output, telling `book` when its context appears and ends.
    /// `on_progress` follows each chunk; breaking out of it stops after the chunk with the
    /// finished layers kept (an [`Error::Cancelled`] or [`Error::Resumable`] to resume).
    pub fn run(
        &self,
        planned: &Planned,
        opts: &BuildOptions,
        book: &mut dyn Bookkeeping,
        on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
    ) -> Result<BuildReport> {
        let mut listed = false;
        let mut progress = |p: &Progress| {
            if !listed {
                listed = true;
                book.started(&self.out);
            }
            on_progress(p)
        };
        let stamp = self.engine.stamp()?;
        let model = &self.engine.model;
        let restarted;
        let opts = match self.restart && !opts.restart {
            true => {
                restarted = BuildOptions { restart: true, ..opts.clone() };
                &restarted
            }
            false => opts,
        };
        let report = match &planned.base {
            Some(file) => {
                extend(model, stamp, Base { file, keep: planned.keep }, &planned.plan, &self.out, opts, &mut progress)
            }
            None => super::build::build(model, stamp, &planned.plan, &self.out, opts, &mut progress),
        };
        book.finished(&self.out, report.as_ref().ok());
        report
    }

    /// The saved context a change starts from, made by this engine's model.
    fn open_base(&self) -> Result<ContextFile> {
        let base = ContextFile::open(self.base.as_deref().unwrap_or(&self.out))?;
        self.engine.check_context_to_change(&base)?;
        Ok(base)
    }

    /// The interrupted prefill of a new context: its documents read again and checked (a
    /// resume must compute the same tokens), its prompt as it was rendered.
    fn resumed_new(&self, pending: &Pending, saved: &dyn SavedDocuments) -> Result<Planned> {
        let spans: Vec<&DocumentSpan> = pending.documents.iter().collect();
        let documents = reread_as_saved(saved, &spans).map_err(|e| {
            Error::Invalid(match e {
                Reread::Unreadable { path, why } => format!(
                    "{} cannot be read ({why}): put it back to resume, or delete the paused context and prefill again",
                    path.display()
                ),
                Reread::Changed { path } => {
                    format!("{path} changed since its prefill started: delete the paused context and prefill again")
                }
            })
        })?;
        let prompt = &pending.header.prompt;
        let plan = self.engine.plan_context(&documents, prompt.system.as_deref(), Some(prompt.date.clone()))?;
        let saved_prefill = Some(pending_prefill(pending)?);
        Ok(Planned { plan, keep: 0, base: None, saved_kv_dtype: Some(pending.header.kv_dtype), saved_prefill })
    }

    /// The interrupted change of the saved context — its checkpoint keeps `base_tokens` of the
    /// saved tokens: the same documents, read again and checked.
    fn resumed_change(&self, pending: &Pending, saved: &dyn SavedDocuments) -> Result<Planned> {
        let base = self.open_base()?;
        let keep = pending.base_tokens;
        let kept = base.documents().iter().take_while(|s| s.start < keep).count();
        let partial = partial_dir(&self.out);
        if keep == 0 || base.tokens_before(kept) != keep || pending.documents.len() < kept {
            return Err(Error::Invalid(format!(
                "the interrupted change of {} does not continue this file (it keeps {keep} of its {} tokens): delete \
                 {} and make the change again",
                base.path().display(),
                base.tokens().len(),
                partial.display()
            )));
        }
        let again: Vec<&DocumentSpan> = pending.documents[kept..].iter().collect();
        let documents = reread_as_saved(saved, &again).map_err(|e| {
            Error::Invalid(match e {
                Reread::Unreadable { path, why } => format!(
                    "{} cannot be read ({why}): put it back to finish the change of {}, or delete {} to keep the \
                     context as it is",
                    path.display(),
                    base.path().display(),
                    partial.display()
                ),
                Reread::Changed { path } => format!(
                    "{path} changed since the change of {} started: delete {} and make the change again",
                    base.path().display(),
                    partial.display()
                ),
            })
        })?;
        let plan = self.engine.plan_keeping(&base, kept, &documents)?;
        let (saved_kv_dtype, saved_prefill) = (Some(base.header().kv_dtype), Some(pending_prefill(pending)?));
        Ok(Planned { keep, plan, saved_kv_dtype, saved_prefill, base: Some(base) })
    }
}

/// The documents of `spans` read again by `saved`, each as it was saved: with the kind its span
/// records (empty in files made before kinds were kept), whatever the reader would name it now,
/// so that a resumed prefill plans — and checksums — the very job it started.
fn reread_as_saved(
    saved: &dyn SavedDocuments,
    spans: &[&DocumentSpan],
) -> std::result::Result<Vec<DocumentText>, Reread> {
    let mut documents = saved.reread(spans)?;
    for (d, span) in documents.iter_mut().zip(spans) {
        d.kind.clone_from(&span.kind);
    }
    Ok(documents)
}

/// Taking `doc` (a path or title) out of `base`: how many documents stay as saved, and the
/// documents to prefill again after them, read again by `saved`. Removing the last document
/// re-prefills the one before it (a prefill computes at least one token: the next token comes
/// from the last position).
fn removal(base: &ContextFile, doc: &str, saved: &dyn SavedDocuments) -> Result<(usize, Vec<DocumentText>)> {
    let spans = base.documents();
    let Some(at) = spans.iter().position(|s| s.path == doc || s.title == doc) else {
        let names: Vec<&str> = spans.iter().map(|s| s.path.as_str()).collect();
        return Err(Error::Invalid(format!(
            "no document \"{doc}\" in {}: its documents are {}",
            base.path().display(),
            names.join(", ")
        )));
    };
    if spans.len() == 1 {
        return Err(Error::Invalid(format!(
            "{doc} is the only document of {}: delete the context instead",
            base.path().display()
        )));
    }
    let kept = if at + 1 == spans.len() { at - 1 } else { at };
    let again: Vec<_> = spans[kept..].iter().enumerate().filter(|(i, _)| kept + i != at).map(|(_, s)| s).collect();
    match reread_as_saved(saved, &again) {
        Ok(documents) => Ok((kept, documents)),
        Err(Reread::Unreadable { path, why }) => Err(Error::Invalid(format!(
            "{} is prefilled again after the removed document but cannot be read ({why}); put it back, or prefill \
             the documents again",
            path.display()
        ))),
        Err(Reread::Changed { path }) => Err(Error::Invalid(format!(
            "{path} changed since it was prefilled; prefill the documents again (or --add its new version)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use folio_context_file::format::checksum;

    fn demo() -> Engine {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap()
    }

    /// Plain text files as the product's reader gives them: the text as it is on disk.
    struct TextFiles;

    fn read(path: &Path) -> std::io::Result<DocumentText> {
        let text = std::fs::read_to_string(path)?;
        Ok(DocumentText {
            title: path.file_name().unwrap().to_string_lossy().into_owned(),
            path: path.display().to_string(),
            bytes: text.len() as u64,
            xxh3: checksum(text.as_bytes()),
            kind: "text".into(),
            text,
            parts: Vec::new(),
        })
    }

    impl SavedDocuments for TextFiles {
        fn reread(&self, spans: &[&DocumentSpan]) -> std::result::Result<Vec<DocumentText>, Reread> {
            spans
                .iter()
                .map(|s| match read(Path::new(&s.path)) {
                    Ok(d) if d.xxh3 == s.xxh3 => Ok(d),
                    Ok(_) => Err(Reread::Changed { path: s.path.clone() }),
                    Err(e) => Err(Reread::Unreadable { path: s.path.clone().into(), why: e.to_string() }),
                })
                .collect()
        }
    }

    fn documents(paths: &[&Path]) -> Vec<DocumentText> {
        paths.iter().map(|p| read(p).unwrap()).collect()
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
        let opts = BuildOptions::new(KvDtype::F32);
        let out = dir.path().join("ctx.folio");
        let builder = Builder::new(&e, &out);
        let go = &mut |_: &Progress| ControlFlow::Continue(());
        let new = Change::New { documents: documents(&[&first, &second]), system: None };
        builder.run(&builder.plan(new, &TextFiles).unwrap(), &opts, &mut (), go).unwrap();

        let stop_after_a_layer = &mut |p: &Progress| match p.layer {
            0 => ControlFlow::Continue(()),
            _ => ControlFlow::Break(()),
        };
        let started = builder.plan(Change::Add(documents(&[&added])), &TextFiles).unwrap();
        let saved_tokens = started.base().unwrap().tokens().len();
        assert_eq!(started.keep, saved_tokens);
        assert!(builder.run(&started, &opts, &mut (), stop_after_a_layer).is_err(), "the addition stopped");
        assert_eq!(pending(&out).unwrap().expect("its checkpoint").base_tokens, saved_tokens);
        assert_eq!(ContextFile::open(&out).unwrap().documents().len(), 2, "the file is as it was");

        let again = builder.plan(Change::Resume, &TextFiles).unwrap();
        assert_eq!((&again.plan.tokens, again.keep), (&started.plan.tokens, started.keep));
        let report = builder.run(&again, &opts, &mut (), go).unwrap();
        assert!(report.resumed_layers >= 1, "{report:?}");

        let whole = dir.path().join("whole.folio");
        let one_go = Builder::new(&e, &whole);
        let all = Change::New { documents: documents(&[&first, &second, &added]), system: None };
        one_go.run(&one_go.plan(all, &TextFiles).unwrap(), &opts, &mut (), go).unwrap();
        let (grown, whole) = (ContextFile::open(&out).unwrap(), ContextFile::open(&whole).unwrap());
        grown.verify().unwrap();
        assert_eq!(grown.tokens(), whole.tokens());
        assert_eq!(grown.documents(), whole.documents());
        for layer in 0..e.config().num_layers {
            assert_eq!(grown.layer_kv(layer).unwrap(), whole.layer_kv(layer).unwrap(), "layer {layer}");
        }

        // Stopped again, then a document edited: the resume is refused, the file kept.
        let more = dir.path().join("more.md");
        std::fs::write(&more, "More notes.\n").unwrap();
        let started = builder.plan(Change::Add(documents(&[&more])), &TextFiles).unwrap();
        let _ = builder.run(&started, &opts, &mut (), stop_after_a_layer);
        std::fs::write(&more, "Edited since.\n").unwrap();
        let err = builder.plan(Change::Resume, &TextFiles).err().unwrap().to_string();
        assert!(err.contains("more.md changed since the change") && err.contains("delete"), "{err}");
    }

    /// Taking a document out keeps the tokens before it and prefills the ones after it again:
    /// the result is the context made without it. The last document cannot be taken out of a
    /// context of one, and a name that is not there lists the documents that are.
    #[test]
    fn a_removal_is_the_context_made_without_the_document() {
        let e = demo();
        let dir = tempfile::tempdir().unwrap();
        let samples = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples"));
        let names = ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"];
        let paths: Vec<PathBuf> = names.iter().map(|n| samples.join(n)).collect();
        let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        let opts = BuildOptions::new(KvDtype::F32);
        let go = &mut |_: &Progress| ControlFlow::Continue(());
        let make = |out: &Path, docs: &[&Path]| {
            let b = Builder::new(&e, out);
            let change = Change::New { documents: documents(docs), system: None };
            b.run(&b.plan(change, &TextFiles).unwrap(), &opts, &mut (), &mut |_| ControlFlow::Continue(())).unwrap();
        };
        let out = dir.path().join("three.folio");
        make(&out, &refs);
        let builder = Builder::new(&e, &out);
        let planned = builder.plan(Change::Remove(names[1].into()), &TextFiles).unwrap();
        let base = ContextFile::open(&out).unwrap();
        assert_eq!(planned.keep, base.tokens_before(1), "the tokens before the removed document are kept");
        builder.run(&planned, &opts, &mut (), go).unwrap();
        let without = dir.path().join("two.folio");
        make(&without, &[refs[0], refs[2]]);
        let (cut, made) = (ContextFile::open(&out).unwrap(), ContextFile::open(&without).unwrap());
        assert_eq!(cut.tokens(), made.tokens());
        assert_eq!(cut.layer_kv(0).unwrap(), made.layer_kv(0).unwrap());

        let err = builder.plan(Change::Remove("nowhere.txt".into()), &TextFiles).err().unwrap().to_string();
        assert!(err.contains("no document \"nowhere.txt\"") && err.contains("field_notes.txt"), "{err}");
        let one = dir.path().join("one.folio");
        make(&one, &refs[..1]);
        let err = Builder::new(&e, &one).plan(Change::Remove(names[0].into()), &TextFiles).err().unwrap().to_string();
        assert!(err.contains("is the only document"), "{err}");
    }
}
