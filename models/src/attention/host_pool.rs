//! The methods' CPU pool: the threads a method's host-side work runs on beside the GPU's step
//! (MagicPIG's walk and attention of its CPU heads, HiP's block search a step ahead), apart
//! from the global pool the rest of the engine uses, so that neither waits behind the other.
//! One pool for every method: a session decodes with one method at a time.

use std::sync::OnceLock;

/// Threads of the pool: `FOLIO_HOST_THREADS` (`HOST_THREADS_VAR`) when set to a positive number, else one per
/// physical core within the CPUs this process may use (a container's quota) — the methods'
/// CPU side is bound by memory bandwidth and FP units, which hyperthreads share. The variable
/// is there to measure the other choice: scattered rows wait on DRAM more than they compute,
/// which a second thread per core may hide.
pub fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var(HOST_THREADS_VAR)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| num_cpus::get_physical().min(num_cpus::get()).max(1))
    })
}

/// The environment variable that sets [`threads`].
const HOST_THREADS_VAR: &str = "FOLIO_HOST_THREADS";

/// The pool, made on first use; `None` when it could not start (the global pool serves then).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new().num_threads(threads()).thread_name(|i| format!("folio-host-{i}")).build().ok()
    })
    .as_ref()
}

/// Runs `f` on the pool and waits for it.
pub(super) fn install<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    match pool() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}
