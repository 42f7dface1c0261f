//! Prefill jobs: queued, run one at a time on a worker thread (a prefill takes the device and
//! the disk; two at once would only share them), reported to the window as snapshots, and
//! cancellable. A job's context is listed in the library as soon as its first layer has a
//! checkpoint, so a window closed or a process killed mid-prefill shows it paused on the next
//! start, and a resume job picks it up from the partial folder alone: the documents' paths,
//! checksums, prompt and K/V dtype are all in its checkpoint. Jobs queued behind it have no
//! partial folder yet: the queue file (`queue.json` in Folio's home) keeps them, and the next
//! start queues them again.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use folio_library::Library;
use folio_models::context::staging::{Skip, StagedDocument};
use folio_models::context::{self, Bookkeeping, BuildOptions, Builder, Change, DocumentText, Progress};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;
use serde::{Deserialize, Serialize};

use crate::ingest;
use crate::listing::{Block, Listing, PrefillKeys};

/// Least time between two progress snapshots sent to the window.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(150);

#[derive(Debug, Clone, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub(crate) enum JobKind {
    /// A new context from staged documents. `prefill` is how its tokens attend (`dense`,
    /// `sparse:KNOBS`; a queue saved by an earlier Folio has none: dense).
    New {
        documents: Vec<StagedDocument>,
        #[serde(default)]
        prefill: Option<String>,
    },
    /// Documents added to a ready context (only they are prefilled).
    Add {
        documents: Vec<StagedDocument>,
        #[serde(default)]
        prefill: Option<String>,
    },
    /// A document (its path) taken out of a ready context (the documents after it are
    /// prefilled again).
    Remove {
        document: String,
        #[serde(default)]
        prefill: Option<String>,
    },
    /// The interrupted prefill or change of a context, from its partial folder.
    Resume,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub(crate) enum JobState {
    Queued,
    Running,
    Done,
    /// Stopped with its finished layers kept: resumable.
    Paused,
    Failed,
}

#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub(crate) struct JobView {
    pub id: u64,
    pub name: String,
    pub path: PathBuf,
    pub state: JobState,
    pub progress: Option<Progress>,
    /// Why it failed or paused.
    pub message: Option<String>,
    /// Documents left out or read again since staging, each with the reason.
    pub notes: Vec<Skip>,
}

struct Queued {
    id: u64,
    out: PathBuf,
    kind: JobKind,
    /// The model it prefills with: the one loaded when it was queued (loading another later
    /// does not change a queued job).
    engine: Arc<Engine>,
}

/// A queued job as the queue file keeps it.
#[derive(Serialize, Deserialize, ts_rs::TS)]
struct SavedJob {
    out: PathBuf,
    kind: JobKind,
    /// The model it was queued with (`Engine::source`).
    model: String,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Queued>,
    /// Jobs an earlier run queued and this one has not queued again (their model is not
    /// loaded yet): kept in the queue file until it is.
    waiting: Vec<SavedJob>,
    /// Why the queue file could not be read at start (told once by [`Jobs::restore`]).
    unreadable: Option<String>,
    /// Every job of this run, oldest first.
    views: Vec<JobView>,
    running: Option<(u64, Arc<AtomicBool>)>,
    next: u64,
}

type Notify = Box<dyn Fn(Vec<JobView>) + Send + Sync>;

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    notify: Notify,
    /// Where the jobs queued and not started are kept (`None`: nowhere, without a library).
    queue_file: Option<PathBuf>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the jobs waiting in `st`'s queue to the queue file (atomically), so a window
    /// closed or killed before they start does not lose them. Resumes are left out: their
    /// context is listed paused with its Resume.
    fn save_queue(&self, st: &State) {
        let Some(file) = &self.queue_file else { return };
        let saved: Vec<&SavedJob> = st.waiting.iter().collect();
        let queued: Vec<SavedJob> = st
            .queue
            .iter()
            .filter(|q| !matches!(q.kind, JobKind::Resume))
            .map(|q| SavedJob { out: q.out.clone(), kind: q.kind.clone(), model: q.engine.source.clone() })
            .collect();
        let saved: Vec<&SavedJob> = saved.into_iter().chain(&queued).collect();
        let written = match saved.is_empty() {
            true => std::fs::remove_file(file).or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e.to_string()),
            }),
            false => serde_json::to_vec(&saved)
                .map_err(|e| e.to_string())
                .and_then(|bytes| context::write_atomic(file, &bytes).map_err(|e| e.to_string())),
        };
        if let Err(e) = written {
            eprintln!("folio: the queued prefills are not saved in {}: {e}", file.display());
        }
    }

    fn publish(&self) {
        let views = self.lock().views.clone();
        (self.notify)(views);
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut JobView)) {
        if let Some(v) = self.lock().views.iter_mut().find(|v| v.id == id) {
            f(v);
        }
    }
}

/// The job queue and its worker thread.
#[derive(Clone)]
pub(crate) struct Jobs {
    shared: Arc<Shared>,
}

/// The app's library handle: `None` while it cannot be opened; replaced by a rebuild.
pub(crate) type SharedLibrary = Arc<Mutex<Option<Library>>>;

/// What a job needs from the app.
pub(crate) struct Worker {
    pub library: SharedLibrary,
}

impl Worker {
    /// The library as it is now (a rebuild in the window replaces it).
    fn library(&self) -> Option<Library> {
        self.library.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Jobs {
    /// Starts the worker; `queue_file` keeps the jobs queued and not started (see
    /// [`Jobs::restore`]).
    pub(crate) fn start(
        worker: Worker,
        queue_file: Option<PathBuf>,
        notify: impl Fn(Vec<JobView>) + Send + Sync + 'static,
    ) -> Self {
        let mut state = State::default();
        if let Some(file) = &queue_file {
            let read = match std::fs::read(file) {
                Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| e.to_string()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e.to_string()),
            };
            match read {
                Ok(saved) => state.waiting = saved.unwrap_or_default(),
                // Set aside, not overwritten: this run keeps its own queue in a new file.
                Err(why) => {
                    let aside = file.with_extension("json.unreadable");
                    let moved = std::fs::rename(file, &aside).map_or_else(
                        |e| format!("; it could not be set aside ({e})"),
                        |()| format!("; it is kept as {}", aside.display()),
                    );
                    state.unreadable =
                        Some(format!("the queued prefills in {} do not read ({why}){moved}", file.display()));
                }
            }
        }
        let shared =
            Arc::new(Shared { state: Mutex::new(state), wake: Condvar::new(), notify: Box::new(notify), queue_file });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("folio-prefill".into())
            .spawn(move || worker_loop(&s, &worker))
            .expect("start the prefill worker thread");
        Self { shared }
    }

    /// Queues a job writing `out` with `engine`; refused while another job of this run writes it.
    pub(crate) fn submit(&self, out: PathBuf, kind: JobKind, engine: Arc<Engine>) -> Result<u64, String> {
        let mut st = self.shared.lock();
        let busy = st.views.iter().any(|v| v.path == out && matches!(v.state, JobState::Queued | JobState::Running));
        if busy {
            return Err(format!("{} is already being prefilled: wait for it or cancel it", out.display()));
        }
        st.next += 1;
        let id = st.next;
        let name = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        st.views.push(JobView {
            id,
            name,
            path: out.clone(),
            state: JobState::Queued,
            progress: None,
            message: None,
            notes: Vec::new(),
        });
        st.queue.push_back(Queued { id, out, kind, engine });
        self.shared.save_queue(&st);
        drop(st);
        self.shared.wake.notify_one();
        self.shared.publish();
        Ok(id)
    }

    /// Cancels a job: a queued one is dropped, a running one stops after its current chunk
    /// and keeps its finished layers.
    pub(crate) fn cancel(&self, id: u64) -> bool {
        let mut st = self.shared.lock();
        let found = if let Some(at) = st.queue.iter().position(|q| q.id == id) {
            st.queue.remove(at);
            self.shared.save_queue(&st);
            if let Some(v) = st.views.iter_mut().find(|v| v.id == id) {
                v.state = JobState::Failed;
                v.message = Some("cancelled before it started".into());
            }
            true
        } else if let Some((running, flag)) = &st.running {
            let hit = *running == id;
            if hit {
                flag.store(true, Ordering::SeqCst);
            }
            hit
        } else {
            false
        };
        drop(st);
        self.shared.publish();
        found
    }

    pub(crate) fn views(&self) -> Vec<JobView> {
        self.shared.lock().views.clone()
    }

    /// Queues again the jobs an earlier run left in the queue file (the window was closed or
    /// killed before they started) that were queued with `engine`'s model; the others stay in
    /// the file until their model is loaded (called at start and after each model load).
    /// Returns what to tell: why the file does not read, or which jobs wait for which model.
    pub(crate) fn restore(&self, engine: &Arc<Engine>) -> Vec<String> {
        let (mine, told) = {
            let mut st = self.shared.lock();
            let waiting = std::mem::take(&mut st.waiting);
            let (mine, other): (Vec<SavedJob>, Vec<SavedJob>) =
                waiting.into_iter().partition(|j| j.model == engine.source);
            let mut told: Vec<String> = st.unreadable.take().into_iter().collect();
            told.extend(other.iter().map(|j| {
                let name = j.out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                format!("{name} waits for {}: load it to start its prefill", j.model)
            }));
            st.waiting = other;
            (mine, told)
        };
        let mut told = told;
        for job in mine {
            let name = job.out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            if let Err(e) = self.submit(job.out, job.kind, engine.clone()) {
                told.push(format!("{name}: {e}"));
            }
        }
        self.shared.save_queue(&self.shared.lock());
        told
    }

    /// Whether a job of this run writes `path` (queued or running): its file must not be
    /// renamed or removed meanwhile.
    pub(crate) fn busy(&self, path: &std::path::Path) -> bool {
        let st = self.shared.lock();
        st.views.iter().any(|v| v.path == path && matches!(v.state, JobState::Queued | JobState::Running))
    }
}

fn worker_loop(shared: &Shared, w: &Worker) {
    loop {
        let (job, cancel) = {
            let mut st = shared.lock();
            let job = loop {
                match st.queue.pop_front() {
                    // Started: from now on its partial folder keeps it.
                    Some(j) => break j,
                    None => st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner()),
                }
            };
            shared.save_queue(&st);
            let cancel = Arc::new(AtomicBool::new(false));
            st.running = Some((job.id, cancel.clone()));
            if let Some(v) = st.views.iter_mut().find(|v| v.id == job.id) {
                v.state = JobState::Running;
            }
            (job, cancel)
        };
        shared.publish();
        // Whether the job changes a saved file (an addition, a removal, or the resume of one),
        // as opposed to making a new context.
        let changes_a_file = match job.kind {
            JobKind::Add { .. } | JobKind::Remove { .. } => true,
            JobKind::New { .. } => false,
            JobKind::Resume => context::pending(&job.out).ok().flatten().is_some_and(|p| p.base_tokens > 0),
        };
        // A panic in a prefill fails its job, not the worker (the queue goes on).
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(shared, w, &job, &cancel)))
            .unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                Err(anyhow::anyhow!("internal error in the prefill ({why}); its finished layers are kept"))
            });
        if result.is_err() {
            // The builder's bookkeeping brought the library up to date when the prefill ran to
            // its end or stopped; a job that failed before it, or panicked inside it, is
            // brought up to date here (the file, the paused prefill, or nothing).
            if let Some(lib) = w.library() {
                Listing::new(lib, Box::new(|f| tauri::async_runtime::block_on(f)), None, changes_a_file)
                    .refresh(&job.out);
            }
        }
        let (state, message) = match &result {
            Ok(()) => (JobState::Done, None),
            // Stopped with its finished layers kept: the same job resumes it.
            Err(e) if resumable(e) => (JobState::Paused, Some(format!("{e:#}"))),
            Err(e) => (JobState::Failed, Some(format!("{e:#}"))),
        };
        if let (JobState::Failed, Some(error)) = (state, &message) {
            tracing::warn!(job = job.id, out = %job.out.display(), %error, "job failed");
        }
        shared.update(job.id, |v| {
            v.state = state;
            v.message = message;
        });
        shared.lock().running = None;
        shared.publish();
    }
}

fn run(shared: &Shared, w: &Worker, job: &Queued, cancel: &AtomicBool) -> anyhow::Result<()> {
    let engine = &job.engine;
    let (change, explicit) = match &job.kind {
        JobKind::New { documents, prefill } => {
            (Change::New { documents: reread_noted(shared, job.id, documents)?, system: None }, prefill)
        }
        JobKind::Add { documents, prefill } => (Change::Add(reread_noted(shared, job.id, documents)?), prefill),
        JobKind::Remove { document, prefill } => (Change::Remove(document.clone()), prefill),
        JobKind::Resume => (Change::Resume, &None),
    };
    let explicit = explicit.as_deref().map(PrefillMode::parse).transpose()?;
    let builder = Builder::new(engine, &job.out);
    let planned = builder.plan(change, &ingest::Files)?;
    // The engine settings as they are when the job starts: a new context's K/V dtype, and the
    // device budget as the prefill's memory budget.
    let settings = match w.library() {
        Some(lib) => tauri::async_runtime::block_on(super::engine::stored(&lib)),
        None => super::engine::EngineSettings::default(),
    };
    // A change or a resume keeps the dtype its file or checkpoint has: the setting is read (and
    // a bad one refused) only for a new context.
    let kv_dtype = match planned.saved_kv_dtype() {
        Some(saved) => saved,
        None => settings.kv_dtype().map_err(anyhow::Error::msg)?,
    };
    // The sheet's choice; a resume keeps the interrupted prefill's.
    let prefill = planned.prefill(explicit);
    let keys = PrefillKeys::new(engine, &folio_models::device_name(engine.model.device()));
    let prior_cost =
        w.library().and_then(|lib| tauri::async_runtime::block_on(keys.read(&lib, prefill)).ok().flatten());
    let memory_budget = memory_budget(engine, &settings)?;
    let opts = BuildOptions { memory_budget, prior_cost, prefill, ..BuildOptions::new(kv_dtype) };
    let mut last = Instant::now() - PROGRESS_INTERVAL;
    let mut on_progress = |p: &Progress| {
        if last.elapsed() >= PROGRESS_INTERVAL {
            last = Instant::now();
            shared.update(job.id, |v| v.progress = Some(p.clone()));
            shared.publish();
        }
        super::until_stopped(cancel)
    };
    let block: Block = Box::new(|f| tauri::async_runtime::block_on(f));
    let mut listing = w.library().map(|lib| Listing::new(lib, block, Some(keys), planned.base().is_some()));
    let book: &mut dyn Bookkeeping = match listing.as_mut() {
        Some(l) => l,
        None => &mut (),
    };
    builder.run(&planned, &opts, book, &mut on_progress)?;
    Ok(())
}

/// What a prefill may use beside the model's weights: the device budget in Settings (which
/// covers the weights too) less the weights.
fn memory_budget(engine: &Engine, settings: &super::engine::EngineSettings) -> anyhow::Result<Option<u64>> {
    let weights = engine.model.weights().device_bytes();
    match settings.budgets().map_err(anyhow::Error::msg)?.device {
        Some(b) if b <= weights => anyhow::bail!(
            "the device memory budget in Settings ({}) does not hold the model's weights ({}): raise it or clear it",
            folio_models::error::human_bytes(b),
            folio_models::error::human_bytes(weights)
        ),
        other => Ok(other.map(|b| b - weights)),
    }
}

/// Whether a job's error left a prefill to resume (a cancel, or a failure after finished
/// layers), as opposed to one that never started or was refused.
fn resumable(e: &anyhow::Error) -> bool {
    use folio_models::error::Error;
    matches!(e.downcast_ref::<Error>(), Some(Error::Resumable { .. } | Error::Cancelled(_)))
}

/// The staged documents read again, the notes shown on the job; none left is an error.
fn reread_noted(shared: &Shared, id: u64, staged: &[StagedDocument]) -> anyhow::Result<Vec<DocumentText>> {
    let (docs, notes) = reread(staged);
    shared.update(id, |v| v.notes = notes);
    if docs.is_empty() {
        anyhow::bail!("none of the staged documents can be read any more: stage them again");
    }
    Ok(docs)
}

/// The staged documents read again: one deleted since is left out, one changed is read as it
/// is now; each is noted for the window.
pub(crate) fn reread(staged: &[StagedDocument]) -> (Vec<DocumentText>, Vec<Skip>) {
    let paths: Vec<PathBuf> = staged.iter().map(|d| folio_context_file::os_path::from_stored(&d.path)).collect();
    let found = ingest::collect_lenient(&paths, &|_, _| {});
    let mut notes: Vec<Skip> = found
        .skipped
        .iter()
        .map(|(p, r)| Skip { path: p.display().to_string(), reason: format!("left out: {r}") })
        .collect();
    for d in &found.documents {
        if staged.iter().any(|s| s.path == d.path && s.xxh3 != d.xxh3) {
            notes.push(Skip {
                path: d.path.clone(),
                reason: "changed since it was staged: its text now is used".into(),
            });
        }
    }
    (found.documents, notes)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn staged(path: &Path, text: &str) -> StagedDocument {
        StagedDocument {
            path: path.display().to_string(),
            title: path.file_name().unwrap().to_string_lossy().into_owned(),
            kind: "text".into(),
            bytes: text.len() as u64,
            file_bytes: text.len() as u64,
            xxh3: folio_models::context::format::checksum(text.as_bytes()),
            tokens: 1,
            parts: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// Between staging and prefill, a document was deleted and another changed: the first is
    /// left out and the second read as it is now, each noted; the rest proceeds.
    #[test]
    fn documents_deleted_or_changed_after_staging_are_noted() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, gone, changed) = (dir.path().join("a.txt"), dir.path().join("b.txt"), dir.path().join("c.txt"));
        for p in [&kept, &gone, &changed] {
            std::fs::write(p, "as staged").unwrap();
        }
        let list = [staged(&kept, "as staged"), staged(&gone, "as staged"), staged(&changed, "as staged")];
        std::fs::remove_file(&gone).unwrap();
        std::fs::write(&changed, "edited since").unwrap();
        let (docs, notes) = reread(&list);
        let titles: Vec<&str> = docs.iter().map(|d| d.title.as_str()).collect();
        assert_eq!(titles, ["a.txt", "c.txt"]);
        assert_eq!(docs[1].text, "edited since");
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].path.ends_with("b.txt") && notes[0].reason.starts_with("left out: cannot read it"));
        assert!(notes[1].path.ends_with("c.txt") && notes[1].reason.starts_with("changed since it was staged"));
        // A resume refuses both: it must compute the tokens it started with.
        let spans = |p: &Path, text: &str| folio_models::context::DocumentSpan {
            title: String::new(),
            path: p.display().to_string(),
            start: 0,
            end: 1,
            bytes: text.len() as u64,
            xxh3: folio_models::context::format::checksum(text.as_bytes()),
            kind: "text".into(),
            parts: Vec::new(),
        };
        use folio_models::context::{Reread, SavedDocuments};
        let saved = [spans(&kept, "as staged"), spans(&changed, "as staged")];
        let err = ingest::Files.reread(&saved.iter().collect::<Vec<_>>()).unwrap_err();
        assert!(matches!(&err, Reread::Changed { path } if path.ends_with("c.txt")), "{err:?}");
        let saved = [spans(&gone, "as staged")];
        let err = ingest::Files.reread(&saved.iter().collect::<Vec<_>>()).unwrap_err();
        assert!(matches!(&err, Reread::Unreadable { path, .. } if path.ends_with("b.txt")), "{err:?}");
    }

    fn demo() -> Arc<Engine> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        Arc::new(Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap())
    }

    /// Waits until `ready` holds for the jobs' views.
    fn wait_for(jobs: &Jobs, what: &str, ready: impl Fn(&[JobView]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !ready(&jobs.views()) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}: {:?}", jobs.views());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Jobs queued behind a running one are in the queue file, and only they; a new run
    /// restores those of its model (they prefill to the end), names the one queued with
    /// another model and keeps it in the file; an unreadable file is set aside.
    #[test]
    fn queued_jobs_outlive_the_window() {
        let (dir, engine) = (tempfile::tempdir().unwrap(), demo());
        let doc = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            staged(&p, text)
        };
        let long = doc("long.txt", &"the ferry leaves at nine from the north pier . ".repeat(600));
        let short = doc("short.txt", "the lucky number of jade tiger is 9 0 4 5 5 .");
        let queue = dir.path().join("queue.json");
        let out = |name: &str| dir.path().join(format!("{name}.folio"));
        let start = || {
            let worker = Worker { library: Arc::new(Mutex::new(None)) };
            Jobs::start(worker, Some(queue.clone()), |_| {})
        };
        let first = start();
        first.submit(out("a"), JobKind::New { documents: vec![long], prefill: None }, engine.clone()).unwrap();
        wait_for(&first, "the first job running", |v| v[0].state == JobState::Running);
        first.submit(out("b"), JobKind::New { documents: vec![short.clone()], prefill: None }, engine.clone()).unwrap();
        first.submit(out("c"), JobKind::New { documents: vec![short.clone()], prefill: None }, engine.clone()).unwrap();
        let saved: Vec<SavedJob> = serde_json::from_slice(&std::fs::read(&queue).unwrap()).unwrap();
        let outs: Vec<&Path> = saved.iter().map(|j| j.out.as_path()).collect();
        assert_eq!(outs, [out("b"), out("c")]);
        // The window is gone: what it left is the file (and a paused first job).
        let left = std::fs::read(&queue).unwrap();
        for v in first.views() {
            first.cancel(v.id);
        }
        wait_for(&first, "the first run stopped", |v| v.iter().all(|j| j.state != JobState::Running));
        assert!(!queue.exists(), "cancelled jobs leave the queue file");

        let short_again = short.clone();
        let mut saved: Vec<SavedJob> = serde_json::from_slice(&left).unwrap();
        saved.push(SavedJob {
            out: out("d"),
            kind: JobKind::New { documents: vec![short], prefill: None },
            model: "other/model".into(),
        });
        std::fs::write(&queue, serde_json::to_vec(&saved).unwrap()).unwrap();
        let second = start();
        let told = second.restore(&engine);
        assert_eq!(told.len(), 1, "{told:?}");
        assert!(told[0].contains("d waits for other/model"), "{told:?}");
        wait_for(&second, "the restored jobs done", |v| v.len() == 2 && v.iter().all(|j| j.state == JobState::Done));
        for name in ["b", "c"] {
            folio_models::context::ContextFile::open(&out(name)).unwrap().verify().unwrap();
        }
        // The job of the other model waits in the file for its model, and a new job of this
        // run does not push it out.
        second.submit(out("e"), JobKind::New { documents: vec![short_again], prefill: None }, engine.clone()).unwrap();
        wait_for(&second, "e done", |v| v.len() == 3 && v.iter().all(|j| j.state == JobState::Done));
        let kept: Vec<SavedJob> = serde_json::from_slice(&std::fs::read(&queue).unwrap()).unwrap();
        assert_eq!(kept.iter().map(|j| j.out.clone()).collect::<Vec<_>>(), [out("d")]);
        assert!(!out("d").exists());

        // An unreadable queue file is set aside and told, never overwritten.
        std::fs::write(&queue, b"{not json").unwrap();
        let third = start();
        let told = third.restore(&engine);
        assert!(told[0].contains("do not read") && told[0].contains("kept as"), "{told:?}");
        assert_eq!(std::fs::read(queue.with_extension("json.unreadable")).unwrap(), b"{not json");
    }
}
