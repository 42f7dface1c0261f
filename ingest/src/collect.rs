//! Files and folders to documents: the walk (sorted, hidden entries and links inside folders
//! skipped with their reason, a file listed twice read once), then every file read in parallel,
//! each on a worker thread of its own under the time limit.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use folio_context_file::platform::{special, Special};

use crate::detect::{self, Format};
use crate::document::{io_message, Document, Refusal};
use crate::extract::extract;
use crate::limits::{bytes, time_hit, Limit, LimitHit, Limits};

/// Time a worker gets past the time limit before it is left behind: our own readers stop at
/// the limit themselves and report it; this is for a third-party parser that does not return.
const WORKER_GRACE: Duration = Duration::from_secs(2);
/// Stack of a reader's worker thread: html5ever and lopdf recurse on some inputs.
const WORKER_STACK_BYTES: usize = 16 << 20;

/// A file or folder left out, and why.
#[derive(Debug, Clone)]
pub struct Skip {
    pub path: PathBuf,
    pub reason: String,
}

/// What a set of paths gave: documents in the order given (folders sorted), and the skips.
#[derive(Debug, Default)]
pub struct Batch {
    pub documents: Vec<Document>,
    pub skipped: Vec<Skip>,
}

/// A path the user named that cannot be read at all (it does not exist, say).
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot read it: {}", .path.display(), io_message(.error))]
pub struct PathError {
    pub path: PathBuf,
    pub error: std::io::Error,
}

enum Entry {
    File(PathBuf),
    Skipped(Skip),
}

/// The documents in `paths`, read under `limits`; `on_read(done, total)` follows the reads.
/// With `strict`, a named path that cannot be read is an error (the CLI: a typo); otherwise it
/// is a skip (the window: a dropped file that vanished).
pub fn read_paths(
    paths: &[PathBuf],
    strict: bool,
    limits: &Limits,
    on_read: &(dyn Fn(usize, usize) + Sync),
) -> Result<Batch, PathError> {
    let entries = walk(paths, strict)?;
    let total = entries.iter().filter(|e| matches!(e, Entry::File(_))).count();
    let done = AtomicUsize::new(0);
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<Result<Document, Skip>>>> = entries.iter().map(|_| Mutex::new(None)).collect();
    // Readers of our own threads, not rayon's pool: lopdf parallelises with rayon inside a
    // read, and a pool whose workers all wait on reads would leave it no thread to run on.
    let readers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(total.max(1));
    std::thread::scope(|scope| {
        for _ in 0..readers {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(entry) = entries.get(i) else { break };
                let result = match entry {
                    Entry::Skipped(skip) => Err(skip.clone()),
                    Entry::File(path) => {
                        let read =
                            read_file(path, limits).map_err(|e| Skip { path: path.clone(), reason: e.to_string() });
                        on_read(done.fetch_add(1, Ordering::Relaxed) + 1, total);
                        read
                    }
                };
                *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
            });
        }
    });
    let results = slots.into_iter().filter_map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()));
    let mut batch = Batch::default();
    for r in results {
        match r {
            Ok(d) => batch.documents.push(d),
            Err(s) => batch.skipped.push(s),
        }
    }
    Ok(batch)
}

fn walk(paths: &[PathBuf], strict: bool) -> Result<Vec<Entry>, PathError> {
    let mut entries = Vec::new();
    let mut seen = BTreeSet::new();
    let skip = |path: &Path, reason: &str| Entry::Skipped(Skip { path: path.to_owned(), reason: reason.to_owned() });
    for root in paths {
        let meta = match std::fs::metadata(root) {
            Ok(m) => m,
            Err(error) if strict && error.kind() == std::io::ErrorKind::NotFound => {
                return Err(PathError { path: root.clone(), error })
            }
            Err(e) => {
                entries.push(skip(root, &format!("cannot read it: {}", io_message(&e))));
                continue;
            }
        };
        if !meta.is_dir() {
            add(root, &mut seen, &mut entries);
            continue;
        }
        // A folder named through a link is walked (the user named it); links inside are not.
        let walk =
            walkdir::WalkDir::new(root).follow_links(false).follow_root_links(true).sort_by_file_name().into_iter();
        // Hidden entries are pruned here (a hidden folder's contents are never visited) and
        // reported when their parent folder is entered.
        let walk = walk.filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
        for entry in walk {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    // A folder that cannot be listed is one skip, not the end of the batch.
                    let path = e.path().unwrap_or(root).to_owned();
                    let why = e.io_error().map_or_else(|| e.to_string(), io_message);
                    entries.push(skip(&path, &format!("cannot read it: {why}")));
                    continue;
                }
            };
            let path = entry.path();
            if entry.file_type().is_dir() {
                hidden_children(path, &mut entries);
            } else if entry.file_type().is_symlink() {
                entries.push(skip(path, "symbolic link inside a folder (not followed; add its target directly)"));
            } else {
                add(path, &mut seen, &mut entries);
            }
        }
    }
    Ok(entries)
}

fn hidden_children(dir: &Path, entries: &mut Vec<Entry>) {
    let Ok(list) = std::fs::read_dir(dir) else { return };
    let mut hidden: Vec<PathBuf> =
        list.flatten().filter(|e| e.file_name().to_string_lossy().starts_with('.')).map(|e| e.path()).collect();
    hidden.sort();
    entries.extend(hidden.into_iter().map(|path| Entry::Skipped(Skip { path, reason: "hidden".into() })));
}

fn add(path: &Path, seen: &mut BTreeSet<PathBuf>, entries: &mut Vec<Entry>) {
    match path.canonicalize() {
        Ok(canonical) => {
            if seen.insert(canonical) {
                entries.push(Entry::File(path.to_owned()));
            } else {
                entries.push(Entry::Skipped(Skip { path: path.to_owned(), reason: "listed twice".into() }));
            }
        }
        Err(e) => entries.push(Entry::Skipped(Skip {
            path: path.to_owned(),
            reason: format!("cannot resolve it: {}", io_message(&e)),
        })),
    }
}

/// One file's document: the file checks (a regular file, under the size limit, unchanged
/// while read), then [`extract`] on a worker thread under the time limit.
pub fn read_file(path: &Path, limits: &Limits) -> Result<Document, Refusal> {
    let bytes = read_checked(path, limits)?;
    let file_bytes = bytes.len() as u64;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (format, extracted) = read_bytes(Arc::new(bytes), &name, limits)?;
    Ok(Document {
        path: path.to_owned(),
        title: name,
        format,
        text: extracted.text,
        parts: extracted.parts,
        file_bytes,
        warnings: extracted.warnings,
    })
}

/// The file's bytes, refused when it is not a regular file, is over the size limit, or
/// changed (size or modification time) while it was read.
fn read_checked(path: &Path, limits: &Limits) -> Result<Vec<u8>, Refusal> {
    use std::io::Read;
    let before = std::fs::metadata(path).map_err(Refusal::Io)?;
    if !before.is_file() {
        // What it is, in the words the context files' checks use (one list of special files).
        let what = special(&before.file_type()).map_or("a special file", Special::words);
        return Err(Refusal::Unsupported(format!("{what}, not a regular file")));
    }
    if before.len() > limits.file_bytes {
        return Err(LimitHit::new(
            Limit::FileSize,
            format!("it is {}, over {}", bytes(before.len()), bytes(limits.file_bytes)),
        )
        .into());
    }
    if before.len() == 0 {
        return Err(Refusal::Empty);
    }
    let mut file = std::fs::File::open(path).map_err(Refusal::Io)?;
    let mut data = Vec::with_capacity(before.len() as usize);
    (&mut file).take(limits.file_bytes + 1).read_to_end(&mut data).map_err(Refusal::Io)?;
    let after = file.metadata().map_err(Refusal::Io)?;
    if data.len() as u64 != before.len()
        || after.len() != before.len()
        || after.modified().ok() != before.modified().ok()
    {
        return Err(Refusal::Changed);
    }
    Ok(data)
}

/// [`extract`] on a thread of its own, as every file is read: a panic becomes
/// [`Refusal::Crashed`], and a reader still running past the time limit is left behind (its
/// result is dropped when it ends).
pub fn read_bytes(bytes: Arc<Vec<u8>>, name: &str, limits: &Limits) -> Result<(Format, crate::Extracted), Refusal> {
    let (send, receive) = mpsc::channel();
    let (owned_name, owned_limits, input) = (name.to_owned(), limits.clone(), Arc::clone(&bytes));
    let spawned =
        std::thread::Builder::new().name("folio-ingest".into()).stack_size(WORKER_STACK_BYTES).spawn(move || {
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| extract(&input, &owned_name, &owned_limits)));
            let _ = send.send(result);
        });
    if let Err(e) = spawned {
        return Err(Refusal::Io(e));
    }
    match receive.recv_timeout(limits.time + WORKER_GRACE) {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            // Detection itself may be what panicked: asked again only under catch_unwind.
            let format = std::panic::catch_unwind(|| detect::detect(&bytes, name).name()).unwrap_or("document");
            Err(Refusal::Crashed { format, detail })
        }
        Err(_) => Err(time_hit(limits.time).into()),
    }
}
