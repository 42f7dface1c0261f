//! A bound on the memory one thread takes while it runs untrusted code in the process — a model
//! folder's chat template — enforced by the global allocator.
//!
//! Why the allocator: a template's steps, recursion and output are bounded by minijinja
//! (folio_models::chat), but one step can double a string (`ns.s = ns.s ~ ns.s`), so forty steps
//! ask for a terabyte; nothing in the template engine sees the size. The allocator does:
//! [`GuardedAlloc`], installed as the `folio` binary's global allocator, counts the net bytes a
//! thread allocates inside [`guarded`] and refuses the allocation that would pass the limit.
//! Rust cannot recover from a refused allocation (it aborts the process), so the refusal
//! first writes the reason to stderr — the program stops at once with words a person can act
//! on, instead of taking the machine's memory and then being killed. Outside a guard, and in
//! programs that do not install it, nothing is counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

/// The allocator the `folio` binary installs: the system's, with the per-thread count.
pub struct GuardedAlloc;

/// The running guard of a thread: bytes allocated less freed since it was armed, its limit, and
/// what it guards (for the message).
#[derive(Clone, Copy)]
struct Guard {
    net: isize,
    limit: isize,
    what: &'static str,
}

thread_local! {
    // Const-initialised and without a destructor: reading it never allocates.
    static GUARD: Cell<Option<Guard>> = const { Cell::new(None) };
}

/// Runs `f` with the memory this thread allocates in it bounded to `limit` bytes (net of what
/// it frees); past the limit the process stops, saying that `what` took more than `limit`.
/// Guards nest: the inner one counts alone while it runs, and what it kept counts to the outer
/// one afterwards. The outer guard is back when `f` returns or unwinds (a caught panic leaves
/// no guard armed on a thread that goes on serving).
pub fn guarded<T>(limit: usize, what: &'static str, f: impl FnOnce() -> T) -> T {
    let limit = isize::try_from(limit).unwrap_or(isize::MAX);
    let outer = GUARD.with(|g| g.replace(Some(Guard { net: 0, limit, what })));
    let _restore = Restore { outer };
    f()
}

/// Puts the outer guard back when dropped, adding what the inner one kept.
struct Restore {
    outer: Option<Guard>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = GUARD.try_with(|g| {
            let kept = g.get().map_or(0, |inner| inner.net);
            g.set(self.outer.map(|o| Guard { net: o.net.saturating_add(kept), ..o }));
        });
    }
}

/// Counts `bytes` more (or fewer, negative) against this thread's guard; false when that
/// passes its limit (the guard is then disarmed, so the message can be written).
fn charge(bytes: isize) -> bool {
    GUARD
        .try_with(|g| match g.get() {
            None => true,
            Some(mut guard) => {
                guard.net = guard.net.saturating_add(bytes);
                if bytes > 0 && guard.net > guard.limit {
                    g.set(None);
                    refuse(guard);
                    return false;
                }
                g.set(Some(guard));
                true
            }
        })
        .unwrap_or(true)
}

/// The words said before the allocation is refused and the process stops.
fn refuse(guard: Guard) {
    let mib = guard.limit >> 20;
    // Unbuffered, into a fixed buffer: nothing here allocates.
    let mut line = [0u8; 512];
    let mut cursor = std::io::Cursor::new(&mut line[..]);
    let _ = writeln!(
        cursor,
        "folio: stopped: {} took more than {mib} MiB of memory, far more than its work needs (a crafted or \
         broken input); Folio ends here rather than take the machine's memory",
        guard.what
    );
    let written = cursor.position() as usize;
    let _ = std::io::stderr().write_all(&line[..written]);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the count only decides
// whether an allocation is refused (null), which the `GlobalAlloc` contract allows.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !charge(layout.size() as isize) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !charge(layout.size() as isize) {
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        charge(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator (the system's) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !charge(new_size as isize - layout.size() as isize) {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
