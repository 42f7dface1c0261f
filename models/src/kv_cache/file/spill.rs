//! A method's state that host memory cannot hold, kept on the disk the file tier reads: at a
//! million keys of the 7B shape MagicPIG's bucket lists are 15–30 GB (2 bytes a key a table,
//! 66–153 tables as the budget asks, 4 KV heads, 26–28 layers) beside a 28 GiB host budget.
//!
//! Why a file of its own, not a section of the context file: a method's index is built from the
//! keys when the method is first chosen for a saved context (no prefill, no rewrite of a 31 GB
//! file to switch a setting), and the file's name is removed as soon as it is open (one a
//! crashed process left is removed by the next spill), so that nothing stays behind on a disk
//! the person did not give to Folio. It lies beside the context file (the same disk) and is
//! read as the tier reads rows: the page cache bypassed (the bench sees the disk's own rate), on
//! the tier's read threads, held to the emulated disk's pace where one is. It is written through
//! the page cache, which the kernel may give back at once.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use folio_context_file::platform::{PositionalIo, DIRECT_ALIGN};
use rayon::prelude::*;

use super::io::{io_pool, open_for_reads, read_into};
use crate::error::{human_bytes, Error, Result};

/// Free bytes a spill leaves on its disk: the context's answers (conversations, a grown file)
/// still need room.
const LEAVE_FREE: u64 = 1 << 30;

/// How a spill's short-lived name begins: `PREFIX` then the process id and a count.
const PREFIX: &str = ".folio-spill-";

/// Removes spills in `dir` that a process no longer running left there (it ended between
/// making one and removing its name), where the platform says which processes run (Linux).
fn remove_stale(dir: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(PREFIX)).and_then(|rest| rest.split('-').next());
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Reads and bytes every spill of this process has read (the bench's figures per step).
static READS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// Reads and bytes read from spills so far, alignment included (a step's are the difference of
/// two readings).
pub fn spill_reads() -> (u64, u64) {
    (READS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed))
}

/// An unnamed file in a directory, written once in pieces and then read at random.
pub struct Spill {
    write: File,
    read: File,
    dir: PathBuf,
    /// Bytes written so far (each piece starts aligned for unbuffered reads).
    len: Mutex<u64>,
}

impl Spill {
    /// A spill in `dir` for `what` (an error's words), refused when the disk has not `bytes`
    /// free beyond [`LEAVE_FREE`] (what the caller will write: a layer's lists and the later
    /// layers' to come). Its first page is written before it is opened for reads, so that the
    /// check of an unbuffered open reads a real page (an empty file says nothing), and its name
    /// is removed as soon as both handles hold it.
    pub fn create(dir: &Path, bytes: u64, what: &str) -> Result<Self> {
        if let Ok(free) = fs4::available_space(dir) {
            if free < bytes.saturating_add(LEAVE_FREE) {
                return Err(Error::Invalid(format!(
                    "{what} take {} of disk beside the context file, and {} has {} free: free some space there, \
                     or give the host budget room for them",
                    human_bytes(bytes),
                    dir.display(),
                    human_bytes(free)
                )));
            }
        }
        remove_stale(dir);
        static MADE: AtomicU64 = AtomicU64::new(0);
        let name = format!("{PREFIX}{}-{}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
        let path = dir.join(name);
        let write = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let first = write.write_all_at(&[0u8; DIRECT_ALIGN], 0).map_err(|e| Error::io(&path, e));
        let read = first.and_then(|()| open_for_reads(&path).map(|(read, _)| read).map_err(|e| Error::io(&path, e)));
        // The name goes now, opened or not: both handles keep the file until they close.
        let removed = std::fs::remove_file(&path);
        let read = read?;
        removed.map_err(|e| Error::io(&path, e))?;
        Ok(Self { write, read, dir: dir.to_owned(), len: Mutex::new(DIRECT_ALIGN as u64) })
    }

    /// Writes `bytes` after what is there, from the next aligned offset; returns that offset.
    /// Not synced: a read that bypasses the page cache has the kernel write the range it reads
    /// first, and the file dies with the process, so a sync would only hold the first step for
    /// the disk's write rate (15 GB of lists at 1M).
    pub fn append(&self, bytes: &[u8]) -> Result<u64> {
        let mut len = self.len.lock().unwrap_or_else(|e| e.into_inner());
        let at = len.next_multiple_of(DIRECT_ALIGN as u64);
        self.write.write_all_at(bytes, at).map_err(|e| self.error("writing", e))?;
        *len = at + bytes.len() as u64;
        Ok(at)
    }

    /// Reads each `(offset, len)` span into its own buffer, in parallel on the tier's read
    /// threads (an NVMe serves its rate only with dozens of reads in flight).
    pub fn read(&self, spans: &[(u64, usize)]) -> Result<Vec<Vec<u8>>> {
        let out = io_pool().install(|| {
            spans
                .par_iter()
                .map(|&(at, len)| {
                    let mut buf = vec![0u8; len];
                    let read = match len {
                        0 => 0,
                        _ => read_into(&self.read, at, &mut buf)?,
                    };
                    Ok((buf, read))
                })
                .collect::<std::io::Result<Vec<_>>>()
        });
        let out = out.map_err(|e| self.error("reading", e))?;
        let bytes: u64 = out.iter().map(|(_, read)| read).sum();
        READS.fetch_add(out.iter().filter(|(_, read)| *read > 0).count() as u64, Ordering::Relaxed);
        BYTES.fetch_add(bytes, Ordering::Relaxed);
        Ok(out.into_iter().map(|(buf, _)| buf).collect())
    }

    fn error(&self, doing: &str, e: std::io::Error) -> Error {
        Error::Invalid(format!("{doing} a spill file in {}: {e}", self.dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_read_back_and_the_file_has_no_name() {
        let dir = tempfile::tempdir().unwrap();
        let spill = Spill::create(dir.path(), 1 << 20, "the test's lists").unwrap();
        let a: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let b: Vec<u8> = (0..300u32).map(|i| (i * 13 + 1) as u8).collect();
        let (at_a, at_b) = (spill.append(&a).unwrap(), spill.append(&b).unwrap());
        assert_eq!(at_a, DIRECT_ALIGN as u64, "after the page that opened it");
        assert_eq!(at_b % DIRECT_ALIGN as u64, 0, "each piece starts aligned");
        assert!(at_b >= a.len() as u64);
        let (reads, _) = spill_reads();
        let got = spill.read(&[(at_b + 10, 200), (at_a + 4095, 3), (at_a, 0), (at_a, 5000)]).unwrap();
        assert_eq!(got, vec![b[10..210].to_vec(), a[4095..4098].to_vec(), Vec::new(), a.clone()]);
        assert!(spill_reads().0 >= reads + 3, "the reads are counted");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(names.is_empty(), "the spill leaves no file behind: {names:?}");
    }

    #[test]
    fn a_spill_left_by_a_process_that_ended_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        // Past Linux's largest process id: no such process runs.
        let stale = dir.path().join(format!("{PREFIX}{}-0", u32::MAX));
        let ours = dir.path().join(format!("{PREFIX}{}-999999", std::process::id()));
        let other = dir.path().join("notes.txt");
        for path in [&stale, &ours, &other] {
            std::fs::write(path, b"x").unwrap();
        }
        let _spill = Spill::create(dir.path(), 1 << 20, "the test's lists").unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        let proc = Path::new("/proc/self").exists();
        assert_eq!(left.contains(&stale), !proc, "{left:?}");
        assert!(left.contains(&ours) && left.contains(&other), "a running process's and other files stay: {left:?}");
    }

    #[test]
    fn a_spill_larger_than_the_free_disk_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = Spill::create(dir.path(), u64::MAX / 2, "magicpig's bucket lists").err().expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("magicpig's bucket lists take") && msg.contains("free"), "{msg}");
    }
}
