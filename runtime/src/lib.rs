//! What Folio's engine asks of the machine it runs on, in one place: the device's memory in use
//! sampled while work runs, the host link's copy rate, the caching allocator's pool, copies
//! between host and device that are queued rather than waited for ([`device`]); and what the
//! operating system says about host memory — free memory, this process's peak, huge pages —
//! with the anonymous maps that ask for 2 MiB pages ([`host_memory`]); the process's host-memory
//! budget and the ledger its large allocations hold their bytes from ([`host_budget`]); whether the CUDA build
//! can use this machine's GPUs, and why not ([`gpu`]); a bound on the memory one thread's
//! untrusted work may take ([`alloc_guard`]); another disk, emulated, for the file tier's
//! reads ([`disk`]).
//!
//! Why a crate of its own: these are neither attention math (folio-kernels holds only kernels)
//! nor the engine's logic (folio-models), and a port to another platform (#45: Windows, macOS)
//! or another allocator changes this crate alone.
//!
//! Rules of this crate (docs/architecture.md):
//!
//! * it depends on candle (tensors, devices; cudarc through candle with `cuda`) and nothing of
//!   Folio's: no model, no method, no file format;
//! * a reading the platform cannot give is `None`, never a guess, and the callers say so;
//! * a copy never outlives the buffers it reads: [`device::Queued`] is waited for before its
//!   source or destination is reused.

pub mod alloc_guard;
pub mod device;
pub mod disk;
pub mod gpu;
pub mod host_budget;
pub mod host_memory;
