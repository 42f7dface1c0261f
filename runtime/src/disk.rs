//! Another disk, emulated (`--disk-gbps`, `--disk-iops`): so that the GPU machine (a virtio
//! disk in a VM) can be measured as a laptop with an NVMe SSD, as `--link-gbps` measures it as
//! a PCIe 4.0 card.
//!
//! Why emulate rather than measure: the machines Folio is measured on have no NVMe, and a disk
//! is the file tier's limit (a step reads thousands of scattered 4 KiB blocks). What matters to
//! a step is the rate at which a disk serves bytes, the reads it serves a second and how long
//! one read takes; an NVMe's figures are published and stable, so a read served from memory
//! (the page cache) and then held until such a disk would have served it gives the step time
//! that disk would give — within the emulation's own overhead, which the bench reports.
//!
//! How: one queue for the whole process, as the disk is one device. A read of `b` bytes issued
//! at `t` occupies the disk for `max(b / rate, 1 / iops)` from the later of `t` and the end of
//! the reads before it, and ends no sooner than [`LATENCY`] plus that after `t` (a read alone
//! still waits for the flash). The reading thread sleeps until then (with its timer slack cut
//! to a nanosecond where the platform allows: Linux's default slack of 50 µs is most of an
//! NVMe read). A read that took longer than the emulated disk would have is counted
//! ([`late_reads`]): the file was not in memory, and the emulation was slower than asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one read of an emulated disk takes when nothing else is queued: 80 µs, a 4 KiB
/// random read of a PCIe 4.0 NVMe at queue depth one (a laptop's drive; desktop ones are near
/// 50 µs).
pub const LATENCY: Duration = Duration::from_micros(80);

/// What an emulated disk serves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskRate {
    /// Bytes a second (sequential).
    pub bytes_per_s: f64,
    /// Reads a second (4 KiB random, at depth).
    pub reads_per_s: f64,
}

/// The emulated disk and the end of the last read queued on it; whether there is one (read
/// first: the real disk's reads take no lock).
static DISK: Mutex<Option<(DiskRate, Instant)>> = Mutex::new(None);
static EMULATED: AtomicBool = AtomicBool::new(false);

/// The slowest rates emulated: 10 MB/s and 100 reads a second (slower, a read's wait would
/// pass what a sleep can say).
pub const MIN_BYTES_PER_S: f64 = 1e7;
pub const MIN_READS_PER_S: f64 = 100.0;
/// Reads slower than the emulated disk since the process started.
static LATE: AtomicU64 = AtomicU64::new(0);

/// Emulates `rate` from now on (`None`: the real disk). The file tier then reads through the
/// page cache, which is the emulated disk's medium.
pub fn set_rate(rate: Option<DiskRate>) {
    let rate = rate.map(|r| DiskRate {
        bytes_per_s: r.bytes_per_s.max(MIN_BYTES_PER_S),
        reads_per_s: r.reads_per_s.max(MIN_READS_PER_S),
    });
    *lock() = rate.map(|r| (r, Instant::now()));
    EMULATED.store(rate.is_some(), Ordering::SeqCst);
}

/// The disk emulated, if one is.
pub fn rate() -> Option<DiskRate> {
    lock().map(|(r, _)| r)
}

/// Reads that took longer than the emulated disk would have, so far.
pub fn late_reads() -> u64 {
    LATE.load(Ordering::Relaxed)
}

/// Holds the calling thread until a read of `bytes` issued at `issued` (and done by now) would
/// have been served by the emulated disk; returns at once when none is emulated. See the
/// module docs.
pub fn pace(issued: Instant, bytes: u64) {
    let Some(done) = queue(issued, bytes) else {
        return;
    };
    let now = Instant::now();
    if now > done {
        LATE.fetch_add(1, Ordering::Relaxed);
        return;
    }
    fine_timer();
    std::thread::sleep(done - now);
}

/// Queues a read on the emulated disk: when it ends.
fn queue(issued: Instant, bytes: u64) -> Option<Instant> {
    if !EMULATED.load(Ordering::Relaxed) {
        return None;
    }
    let mut disk = lock();
    let (rate, free) = disk.as_mut()?;
    let serve = Duration::from_secs_f64((bytes as f64 / rate.bytes_per_s).max(1.0 / rate.reads_per_s));
    let end = issued.max(*free) + serve;
    *free = end;
    Some(end.max(issued + LATENCY + serve))
}

fn lock() -> std::sync::MutexGuard<'static, Option<(DiskRate, Instant)>> {
    DISK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Cuts this thread's timer slack to a nanosecond, once per thread (Linux; elsewhere sleeps
/// keep the platform's granularity and the emulated reads run a little long).
fn fine_timer() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    DONE.with(|done| {
        if !done.replace(true) {
            #[cfg(target_os = "linux")]
            // SAFETY: PR_SET_TIMERSLACK takes one integer argument and touches no memory.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulated disk's rules on one queue: a lone read takes its latency, reads queued
    /// together take the larger of their bytes at the rate and their count at the IOPS, a read
    /// issued after the queue drained starts afresh. (On `queue`, not `pace`: the process's
    /// one disk would be shared with other tests.)
    #[test]
    fn reads_queue_at_the_rate_and_the_iops() {
        set_rate(Some(DiskRate { bytes_per_s: 4e9, reads_per_s: 1e5 }));
        let t = Instant::now();
        let lone = queue(t, 4096).unwrap() - t;
        assert_eq!(lone, LATENCY + Duration::from_secs_f64(1e-5), "{lone:?}");
        // 100 small reads at once: the IOPS bounds them (1 ms), not the bytes (0.1 ms).
        let t = t + Duration::from_secs(1);
        let last = (0..100).fold(t, |_, _| queue(t, 4096).unwrap()) - t;
        assert!((last.as_secs_f64() - 1e-3).abs() < 1e-6, "{last:?}");
        // 10 reads of 4 MB: the rate bounds them (10 ms).
        let t = t + Duration::from_secs(1);
        let last = (0..10).fold(t, |_, _| queue(t, 4_000_000).unwrap()) - t;
        assert!((last.as_secs_f64() - 1e-2).abs() < 1e-6, "{last:?}");
        set_rate(None);
        assert_eq!(queue(t, 1), None);
        // Rates below the slowest emulated are held to it.
        set_rate(Some(DiskRate { bytes_per_s: 1e-300, reads_per_s: 0.0 }));
        assert_eq!(rate(), Some(DiskRate { bytes_per_s: MIN_BYTES_PER_S, reads_per_s: MIN_READS_PER_S }));
        set_rate(None);
    }
}
