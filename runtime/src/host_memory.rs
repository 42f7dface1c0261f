//! What Linux says about host memory — the machine's free memory, this process's peak and its
//! share in huge pages (/proc) — and anonymous maps that ask for 2 MiB pages: read and made in
//! one place for the context build, MagicPIG's tables, the offloaded tier and the benchmarks.
//! Elsewhere than Linux the readings are `None` and the maps have the system's pages.

/// `MemAvailable` of /proc/meminfo: what can be allocated without swapping.
pub fn available() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

/// `MemTotal` of /proc/meminfo: the machine's memory.
pub fn total() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemTotal:")
}

/// Resident set size of this process now (`VmRSS`): its heap, maps and page-locked memory
/// touched, file pages mapped and read.
pub fn rss() -> Option<u64> {
    proc_kib("/proc/self/status", "VmRSS:")
}

/// This process's resident anonymous and shared memory (`RssAnon` + `RssShmem`): what it holds
/// that the machine's available memory does not count (its file pages are reclaimable cache).
pub fn anonymous() -> Option<u64> {
    Some(proc_kib("/proc/self/status", "RssAnon:")? + proc_kib("/proc/self/status", "RssShmem:").unwrap_or(0))
}

/// The memory limit of this process's cgroup (v2 `memory.max`, else v1
/// `memory.limit_in_bytes`), where there is one: inside a container the machine's memory is
/// not what the process may take.
pub fn cgroup_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok();
    // v1 reports "no limit" as a number near 2^63.
    read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
        .filter(|&l| l < 1 << 60)
}

/// Peak resident set size of this process (`VmHWM`).
pub fn peak_rss() -> Option<u64> {
    proc_kib("/proc/self/status", "VmHWM:")
}

/// This process's anonymous memory now in transparent huge pages (`AnonHugePages` of
/// `smaps_rollup`): whether a [`anon_huge`] hint was honoured — the kernel may refuse it
/// (`never`), or find no free 2 MiB pages, and the scattered reads of a host tier slow down.
pub fn huge_page_bytes() -> Option<u64> {
    proc_kib("/proc/self/smaps_rollup", "AnonHugePages:")
}

/// Starts [`peak_rss`] over from what is resident now (Linux resets `VmHWM` when "5" is
/// written to `clear_refs`), so that a benchmark reads each run's peak, not the process's.
pub fn reset_peak_rss() {
    // Best effort: elsewhere than Linux (or in a sandbox that forbids it) the peak stays the
    // process's, which is never less than the run's.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Evicts a fully written file from the page cache, so that its next read comes from the disk
/// as after a reboot (a cold reopen, the disk's read rate). Elsewhere than Linux: nothing.
pub fn drop_page_cache(path: &std::path::Path) {
    #[cfg(target_os = "linux")]
    if let Ok(f) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: an advisory call on a valid, open file descriptor.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = path;
}

/// The `key: N kB` line of a /proc file, in bytes.
fn proc_kib(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// `bytes` (at least one) of zeroed anonymous memory, asked for 2 MiB pages before anything is
/// written to it (the kernel backs a page with a huge one when it is first touched, where
/// transparent huge pages are on for `madvise`, the usual setting). Why: scattered reads of GBs
/// (MagicPIG's bucket runs and sampled rows) miss the TLB on nearly every read with 4 KiB pages,
/// and each miss's page-table entry is itself a DRAM miss; with 2 MiB pages the entries stay
/// cached. A `Vec` cannot ask: its memory comes from the allocator, already touched or shared
/// with other data. A hint: refused, the map has the system's pages and the same contents.
pub fn anon_huge(bytes: usize) -> std::io::Result<memmap2::MmapMut> {
    let map = memmap2::MmapMut::map_anon(bytes.max(1))?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Linux the readings are there and plausible; a map is zeroed and writable.
    #[test]
    fn readings_and_maps() {
        if cfg!(target_os = "linux") {
            let (free, peak) = (available().unwrap(), peak_rss().unwrap());
            assert!(free > 0 && peak > 0, "{free} {peak}");
            let (total, now) = (total().unwrap(), rss().unwrap());
            // (VmHWM is updated lazily: it can read below VmRSS for a moment.)
            assert!(total >= free && now > 0, "{total} {now}");
            assert!(anonymous().is_some_and(|a| a > 0 && a <= now + (64 << 20)));
            assert!(huge_page_bytes().is_some());
        }
        let mut map = anon_huge(3 * 4096 + 5).unwrap();
        assert!(map.len() >= 3 * 4096 + 5 && map.iter().all(|&b| b == 0));
        map[4096] = 7;
        assert_eq!(map[4096], 7);
        assert!(proc_kib("/proc/meminfo", "NoSuchKey:").is_none());
    }
}
