//! The partial folder's bookkeeping for a prefill job: where the hidden states live, the
//! stores and their persists for checkpoints, each layer's K/V written by threads of their own,
//! a fresh folder preallocated (a full disk found before any work), and the errors that say
//! which job a folder holds or that the disk is full.

use folio_context_file::platform::PositionalIo;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Tensor;
use folio_context_file::format::{checksum, Header, SectionKind};
use folio_context_file::partial::{write_checkpoint, Checkpoint, CHECKPOINT_FORMAT, CHECKPOINT_VERSION};
use folio_runtime::device::Queued;

use super::{HiddenPlace, Job, Ledger, Paths, StageSeconds, RAM_HEADROOM, RAM_HIDDEN_COPIES, SECTIONS_BEFORE_LAYERS};
use crate::context::encode::EncodeTensor;
use crate::error::{human_bytes, Error, Result};
use crate::prefill::{layer_output, FileHidden, HiddenSnapshot, HiddenStore, HostHidden, MemoryHidden};

impl Job<'_> {
    /// Where the hidden states go when the caller does not say. On a GPU: the device when both
    /// stores fit the budget beside the working set, RAM when it has room for both, else files
    /// (the trips through files were most of a 7B prefill there). On the CPU, files: compute
    /// dominates, the page cache makes them nearly free, RAM stays for the model and its K/V,
    /// and every layer is a checkpoint.
    pub(super) fn hidden_place(&self, working_set: u64, budget: Option<u64>) -> HiddenPlace {
        let both = 2 * self.hidden_bytes();
        if !self.model.device().is_cuda() {
            HiddenPlace::Files
        } else if budget.is_some_and(|b| working_set + both <= b) {
            HiddenPlace::Device
        } else if folio_runtime::host_memory::available()
            .is_some_and(|free| free >= RAM_HIDDEN_COPIES * self.hidden_bytes() + RAM_HEADROOM)
        {
            HiddenPlace::Ram
        } else {
            HiddenPlace::Files
        }
    }

    /// An empty store of `place` (a file store writes `path`).
    pub(super) fn store(&self, place: HiddenPlace, path: &Path) -> Result<HiddenStore> {
        let (cfg, n) = (self.model.config(), self.computed().len());
        let (dtype, device) = (self.model.dtype(), self.model.device());
        Ok(match place {
            HiddenPlace::Device => HiddenStore::Device(MemoryHidden::new(n, cfg.hidden_size, dtype, device)?),
            HiddenPlace::Ram => HiddenStore::Host(HostHidden::new(n, self.chunk, cfg.hidden_size, dtype, device)),
            HiddenPlace::Files => {
                let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| Error::io(path, e))?;
                HiddenStore::File(Box::new(FileHidden::new(f, path, cfg.hidden_size, dtype, device)))
            }
        })
    }

    /// Starts writing layer `layer`'s output (`layer_output`) to hidden file `file` on a thread
    /// of `scope`: the copy off the device happens here, the disk write beside the next layers.
    pub(super) fn start_persist<'scope>(
        &self,
        hidden: &[HiddenStore; 2],
        layer: usize,
        file: usize,
        paths: &Paths,
        scope: &'scope std::thread::Scope<'scope, '_>,
        stages: &mut StageSeconds,
    ) -> Result<Persist<'scope>> {
        let at = Instant::now();
        let snapshot: HiddenSnapshot = layer_output(hidden, layer)
            .snapshot(self.computed().len())?
            .ok_or_else(|| Error::Invalid("internal: a file store has no snapshot to persist".into()))?;
        let snapshot_secs = at.elapsed().as_secs_f64();
        stages.hidden_io += snapshot_secs;
        let path = paths.hidden[file].clone();
        let f = OpenOptions::new().write(true).open(&path).map_err(|e| self.io(&path, e))?;
        let writer = scope.spawn(move || {
            let at = Instant::now();
            snapshot.write_to(&f).map(|sum| (sum, at.elapsed().as_secs_f64()))
        });
        Ok(Persist { layer, file, path, snapshot_secs, writer })
    }

    /// Waits for a layer's K/V sections to reach the file; their checksums. Their buffers go
    /// back to `spare`. The writer's layer is the last one `marks` ends: the wait for the device
    /// to finish it is the layer's time, not the store's.
    pub(super) fn finish_store(&self, w: StoreWriter<'_>, ledger: &mut Ledger, tmp: &Path) -> Result<()> {
        ledger.marks.last().map(Queued::wait).transpose()?;
        let at = Instant::now();
        let (written, buffers) = w.join().map_err(|_| Error::Invalid("the K/V writer panicked".into()))?;
        ledger.stages.store += at.elapsed().as_secs_f64();
        for (slot, b) in ledger.spare.iter_mut().zip(buffers) {
            *slot = b;
        }
        let sums = written.map_err(|e| match e {
            StoreError::Encode(e) => e,
            StoreError::Write(e) => self.io(tmp, e),
        })?;
        ledger.sections.extend(sums);
        Ok(())
    }

    /// Starts layer `layer`'s K and V on their way to the file: encoded in the file's dtype
    /// where they are, then copied to the host, written and hashed by threads of their own
    /// beside the next layer's compute (`PendingSection::finish_into`), into the buffers the
    /// previous layer's writer gave back.
    pub(super) fn start_store<'scope>(
        &self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        file: &'scope File,
        layer: usize,
        (k, v): (Tensor, Tensor),
        ledger: &mut Ledger,
    ) -> Result<StoreWriter<'scope>> {
        let at = Instant::now();
        let mut pieces = Vec::with_capacity(2);
        for (i, (kind, x)) in [(SectionKind::Keys, k), (SectionKind::Values, v)].into_iter().enumerate() {
            let pending = self.job.kv_dtype.codec(kind).start_encode(&x, self.model.config().head_dim)?;
            let s = self.job.section(kind, Some(layer)).expect("every layer has K and V sections");
            pieces.push((s.offset, pending, std::mem::take(&mut ledger.spare[i])));
        }
        ledger.stages.encode += at.elapsed().as_secs_f64();
        Ok(scope.spawn(move || {
            // K and V side by side, each copied, written and hashed on a thread of its own:
            // nothing hides the last layer's store (or one slower than a layer).
            let done: Vec<_> = std::thread::scope(|s| {
                let each = pieces.into_iter().map(|(at, pending, mut bytes)| {
                    s.spawn(move || {
                        let written = pending.finish_into(&mut bytes).map_err(StoreError::Encode).and_then(|()| {
                            file.write_all_at(&bytes, at).map_err(StoreError::Write)?;
                            start_write_back(file, at, bytes.len());
                            Ok(checksum(&bytes))
                        });
                        (written, bytes)
                    })
                });
                let each: Vec<_> = each.collect();
                each.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
            });
            let (sums, buffers): (Vec<_>, Vec<_>) = done.into_iter().unzip();
            (sums.into_iter().collect(), buffers)
        }))
    }

    /// Waits for a persist and writes the checkpoint it makes resumable: layers up to its
    /// layer done, their sections' checksums (every section up to it must be written), its
    /// hidden file. Returns what the checkpoint cost: the copy off the device and the write.
    pub(super) fn finish_persist(&self, p: Persist<'_>, ledger: &mut Ledger, cp_path: &Path) -> Result<f64> {
        let at = Instant::now();
        let written = p.writer.join().map_err(|_| Error::Invalid("the hidden-state writer panicked".into()))?;
        let (sum, write_secs) = written.map_err(|e| self.io(&p.path, e))?;
        let checkpoint = &mut ledger.checkpoint;
        checkpoint.hidden = sum;
        checkpoint.hidden_file = Some(p.file);
        checkpoint.layers_done = p.layer + 1;
        checkpoint.checksums = ledger.sections[..SECTIONS_BEFORE_LAYERS + 2 * (p.layer + 1)].to_vec();
        write_checkpoint(cp_path, checkpoint)?;
        ledger.checkpoints += 1;
        ledger.stages.store += at.elapsed().as_secs_f64();
        Ok(p.snapshot_secs + write_secs)
    }

    /// A new partial folder: preallocated files, the small sections, checkpoint at layer 0.
    pub(super) fn start_fresh(&self, paths: &Paths) -> Result<Checkpoint> {
        let (cp_path, tmp, hidden_paths) = (&paths.checkpoint, &paths.tmp, &paths.hidden);
        for p in [cp_path, tmp, &hidden_paths[0], &hidden_paths[1]] {
            match std::fs::remove_file(p) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(Error::io(p, e)),
                _ => {}
            }
        }
        let needed = self.job.file_bytes + 2 * self.hidden_bytes();
        if let Ok(free) = fs4::available_space(self.dir) {
            if free < needed {
                return Err(self.disk_full(format!("{} free", human_bytes(free))));
            }
        }
        let file = self.create(tmp, self.job.file_bytes)?;
        for p in hidden_paths {
            self.create(p, self.hidden_bytes())?;
        }
        let tokens: Vec<u8> = self.plan.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        for (kind, bytes) in [(SectionKind::Tokens, &tokens), (SectionKind::Documents, &self.docs_json)] {
            let s = self.job.section(kind, None).expect("the layout has the small sections");
            self.write_at(&file, tmp, s.offset, bytes)?;
        }
        sync(&file, tmp)?;
        let cp = Checkpoint {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            job: self.job.clone(),
            compute: self.compute(),
            chunk: self.chunk,
            layers_done: 0,
            checksums: vec![checksum(&tokens), checksum(&self.docs_json)],
            hidden: String::new(),
            hidden_file: None,
            base_tokens: self.base_tokens(),
        };
        write_checkpoint(cp_path, &cp)?;
        Ok(cp)
    }

    /// Creates `path` with `bytes` allocated on disk (not a sparse file): a disk too small for
    /// the prefill fails here, before any compute.
    pub(super) fn create(&self, path: &Path, bytes: u64) -> Result<File> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| self.io(path, e))?;
        if bytes > 0 {
            <File as fs4::FileExt>::allocate(&f, bytes).map_err(|e| self.io(path, e))?;
        }
        Ok(f)
    }

    pub(super) fn write_at(&self, file: &File, path: &Path, offset: u64, bytes: &[u8]) -> Result<()> {
        file.write_all_at(bytes, offset).map_err(|e| self.io(path, e))
    }

    pub(super) fn io(&self, path: &Path, e: std::io::Error) -> Error {
        if is_disk_full(&e) {
            self.disk_full(e.to_string())
        } else {
            Error::io(path, e)
        }
    }

    pub(super) fn disk_full(&self, detail: String) -> Error {
        Error::DiskFull {
            path: self.out.to_owned(),
            needed: self.job.file_bytes + 2 * self.hidden_bytes(),
            file: self.job.file_bytes,
            detail,
        }
    }

    pub(super) fn mismatch(&self, cp: &Checkpoint) -> Error {
        let what = if cp.base_tokens != self.base_tokens() {
            if cp.base_tokens > 0 {
                "it adds documents to the saved context (rerun with --context and the same --add)".to_owned()
            } else {
                "it prefills every document, not an addition".to_owned()
            }
        } else if cp.compute != self.compute() {
            format!("it ran on {} and this run is {}", cp.compute, self.compute())
        } else if cp.job.model != self.job.model {
            format!("it used model {}", cp.job.model.name)
        } else if cp.job.kv_dtype != self.job.kv_dtype {
            format!("it stores {} K/V", cp.job.kv_dtype.name())
        } else if cp.job.prefill.is_empty() && !self.job.prefill.is_empty() {
            "it was started by an earlier Folio, whose checkpoint this one does not resume".to_owned()
        } else if cp.job.prefill_runs() != self.job.prefill_runs() {
            let modes: Vec<String> = cp.job.prefill_runs().into_iter().map(|r| r.mode).collect();
            format!("its prefill was {} (--prefill)", modes.join(" then "))
        } else {
            format!("its documents or prompt differ ({} tokens then, {} now)", cp.job.tokens, self.job.tokens)
        };
        Error::Invalid(format!(
            "an interrupted prefill of {} is waiting in {} but does not match this one: {what}; \
             rerun the original command to resume it, or pass --restart to discard it",
            self.out.display(),
            self.dir.display()
        ))
    }

    /// The job's header with every section's checksum filled in.
    pub(super) fn finished_header(&self, cp: &Checkpoint) -> Result<Header> {
        let mut header = self.job.clone();
        if cp.checksums.len() != header.sections.len() {
            return Err(Error::Invalid(format!(
                "the checkpoint in {} lists {} checksums for {} sections; pass --restart",
                self.dir.display(),
                cp.checksums.len(),
                header.sections.len()
            )));
        }
        for (s, sum) in header.sections.iter_mut().zip(&cp.checksums) {
            s.xxh3 = sum.clone();
        }
        if header.to_json().len() != self.job.to_json().len() {
            return Err(Error::Invalid("internal: the finished header changed length".into()));
        }
        Ok(header)
    }
}

/// A layer's hidden states on their way to a hidden file, for a checkpoint.
pub(super) struct Persist<'scope> {
    layer: usize,
    file: usize,
    path: PathBuf,
    /// Seconds the copy off the device (or out of the store) held the prefill up.
    snapshot_secs: f64,
    /// The write: the checksum of what it wrote, and its seconds.
    pub(super) writer: std::thread::ScopedJoinHandle<'scope, std::io::Result<(String, f64)>>,
}

/// A layer's K and V sections on their way off the device and into the context file: their
/// checksums, and the buffers back.
pub(super) type StoreWriter<'scope> =
    std::thread::ScopedJoinHandle<'scope, (std::result::Result<Vec<String>, StoreError>, Vec<Vec<u8>>)>;

/// Why a layer's K/V did not reach the file: its copy off the device (or its encode), or the
/// write (which [`Job::io`] tells apart from a full disk).
pub(super) enum StoreError {
    Encode(Error),
    Write(std::io::Error),
}

/// An error that says the disk (or the user's quota) is full.
fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::StorageFull | ErrorKind::FileTooLarge | ErrorKind::QuotaExceeded)
}

/// Starts writing `len` bytes at `offset` of `file` back to the disk without waiting for them.
/// Advisory: an error here loses nothing, as the finished file's fsync still makes every byte
/// durable or fails.
#[cfg(target_os = "linux")]
fn start_write_back(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is open for the call's duration; sync_file_range only schedules I/O.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn start_write_back(_: &File, _: u64, _: usize) {}

pub(super) fn sync(file: &File, path: &Path) -> Result<()> {
    file.sync_all().map_err(|e| Error::io(path, e))
}
