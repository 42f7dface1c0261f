//! How the file tier reads the disk: a pool of threads that keeps dozens of reads in flight,
//! reads aligned for a file opened without the page cache into buffers kept between reads, and
//! held to the emulated disk's pace where one is ([`folio_runtime::disk`]).

use std::fs::File;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use folio_context_file::platform::{open_unbuffered, read_aligned, DIRECT_ALIGN};
use folio_runtime::disk;

/// Threads that read the file, each one read at a time: the reads a disk has in flight. 64: a
/// PCIe 4.0 NVMe serves its 4 KiB rate at a queue depth of 32 to 64.
pub const IO_THREADS: usize = 64;

/// Bytes of each read thread's buffer, kept between its reads (a larger read maps its own): a
/// fresh map a read cost a page fault a page and, unmapped, a TLB flush on every core running
/// the process — at 64 threads half the reads of an emulated NVMe ran late.
const SCRATCH_BYTES: usize = 64 << 10;

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<memmap2::MmapMut>> = const { std::cell::RefCell::new(None) };
}

/// The file at `path` opened for the tier's reads, and whether they bypass the page cache: they
/// do unless another disk is emulated (whose medium is the page cache) or the file system
/// refuses.
pub fn open_for_reads(path: &Path) -> std::io::Result<(File, bool)> {
    match disk::rate() {
        Some(_) => Ok((File::open(path)?, false)),
        None => open_unbuffered(path),
    }
}

/// Reads `need` bytes at `offset` (a multiple of [`DIRECT_ALIGN`]) of a file from
/// [`open_for_reads`] into `buf` (page-aligned), at the emulated disk's pace where one is.
pub fn read_paced(file: &File, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
    let issued = Instant::now();
    read_aligned(file, buf, offset, need)?;
    disk::pace(issued, buf.len().min(need.next_multiple_of(DIRECT_ALIGN)) as u64);
    Ok(())
}

/// `len` bytes from `offset` of `file`, read aligned for an unbuffered file: a page-aligned
/// buffer and where the bytes start in it; its length is the bytes read.
pub(super) fn read_span(file: &File, offset: u64, len: usize) -> std::io::Result<(memmap2::MmapMut, usize)> {
    let (start, skip, read) = aligned(offset, len);
    // An anonymous map: page-aligned, as unbuffered reads want.
    let mut buf = memmap2::MmapMut::map_anon(read)?;
    read_paced(file, &mut buf, start, skip + len)?;
    Ok((buf, skip))
}

/// The aligned read that covers `len` bytes at `offset`: where it starts, where the bytes start
/// in it, and its length.
fn aligned(offset: u64, len: usize) -> (u64, usize, usize) {
    let start = offset / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64;
    let skip = (offset - start) as usize;
    (start, skip, (skip + len).next_multiple_of(DIRECT_ALIGN))
}

/// The `rows` fp8 scales at `offset` of `file`.
pub(super) fn read_scales(file: &File, offset: u64, rows: usize) -> std::io::Result<Vec<f32>> {
    let (bytes, skip) = read_span(file, offset, 4 * rows)?;
    Ok(bytes[skip..skip + 4 * rows].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The pool of [`IO_THREADS`] that reads the file (the cores' pool widens what they read).
pub(super) fn io_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(IO_THREADS)
            .thread_name(|i| format!("folio-disk-{i}"))
            .build()
            .expect("the file tier's read threads")
    })
}

/// Reads `out.len()` bytes at `offset` of `file` into `out` through the calling thread's kept
/// buffer (a read larger than it through one of its own): the bytes read, alignment included.
pub(super) fn read_into(file: &File, offset: u64, out: &mut [u8]) -> std::io::Result<u64> {
    let len = out.len();
    let (start, skip, read) = aligned(offset, len);
    if read > SCRATCH_BYTES {
        let (bytes, skip) = read_span(file, offset, len)?;
        out.copy_from_slice(&bytes[skip..skip + len]);
        return Ok(bytes.len() as u64);
    }
    SCRATCH.with_borrow_mut(|scratch| {
        let buf = match scratch {
            Some(buf) => buf,
            None => scratch.insert(memmap2::MmapMut::map_anon(SCRATCH_BYTES)?),
        };
        read_paced(file, &mut buf[..read], start, skip + len)?;
        out.copy_from_slice(&buf[skip..skip + len]);
        Ok(read as u64)
    })
}

/// Reads of one [`PROBE_BLOCK`] at spread places of a file that [`block_read_rate`] makes at
/// most, and the time it reads for at most (a slow disk — a hard disk serves ~100 reads a
/// second — is measured on the reads done by then: the window asks while a person waits).
const PROBE_READS: u64 = 4096;
const PROBE_BLOCK: usize = 4096;
const PROBE_TIME: std::time::Duration = std::time::Duration::from_millis(250);

/// The rate a step's reads get from the disk under `path`, bytes a second: up to
/// [`PROBE_READS`] blocks of 4 KiB at places spread over the file (for [`PROBE_TIME`] at most),
/// read as the tier reads its misses (in parallel on its threads, the page cache bypassed,
/// paced where a disk is emulated).
pub fn block_read_rate(path: &Path) -> std::io::Result<f64> {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    let (file, _) = open_for_reads(path)?;
    let blocks = file.metadata()?.len() / PROBE_BLOCK as u64;
    if blocks == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "it holds no whole 4 KiB block"));
    }
    let done = AtomicU64::new(0);
    let seconds = io_pool().install(|| {
        // Timed from when the pool takes the probe (a step's reads may hold it first); a read
        // for each thread whatever the time.
        let started = Instant::now();
        (0..PROBE_READS).into_par_iter().try_for_each(|i| {
            if i >= IO_THREADS as u64 && started.elapsed() > PROBE_TIME {
                return Ok(());
            }
            // A multiplicative hash of `i`: neighbouring reads far apart in the file.
            let at = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % blocks) * PROBE_BLOCK as u64;
            read_into(&file, at, &mut [0u8; PROBE_BLOCK])?;
            done.fetch_add(1, Ordering::Relaxed);
            Ok::<_, std::io::Error>(())
        })?;
        Ok::<_, std::io::Error>(started.elapsed().as_secs_f64())
    })?;
    Ok((done.into_inner() as usize * PROBE_BLOCK) as f64 / seconds.max(f64::MIN_POSITIVE))
}

#[cfg(test)]
mod tests {
    /// The probe reads a file of a few blocks and says a rate; a file without a whole block is
    /// refused.
    #[test]
    fn block_read_rate_reads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows");
        std::fs::write(&path, vec![7u8; 5 * super::PROBE_BLOCK]).unwrap();
        let rate = super::block_read_rate(&path).unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        std::fs::write(&path, [1u8; 100]).unwrap();
        let err = super::block_read_rate(&path).unwrap_err().to_string();
        assert!(err.contains("no whole 4 KiB block"), "{err}");
    }
}
