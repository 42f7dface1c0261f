//! The allocator's guard counts a thread's net allocations inside `guarded` only: memory freed
//! inside counts off, what other threads allocate is not counted, guards nest and restore the
//! outer one, and the limit is met by the allocation that passes it — shown in a child process,
//! which must stop with the guard's words (a refused allocation ends a Rust process).

use std::process::Command;

use folio_runtime::alloc_guard::{guarded, GuardedAlloc};

#[global_allocator]
static ALLOCATOR: GuardedAlloc = GuardedAlloc;

const MIB: usize = 1 << 20;
/// Set in the child process this test starts: it then passes a guard's limit.
const CHILD: &str = "FOLIO_ALLOC_GUARD_CHILD";

#[test]
fn memory_freed_inside_a_guard_counts_off_and_guards_nest() {
    guarded(4 * MIB, "the test", || {
        // 64 MiB in all, never more than 1 MiB at once.
        for _ in 0..64 {
            drop(std::hint::black_box(vec![1u8; MIB]));
        }
        // Another thread's allocations are its own.
        std::thread::spawn(|| drop(std::hint::black_box(vec![1u8; 16 * MIB]))).join().unwrap();
        let kept = guarded(2 * MIB, "the inner work", || vec![1u8; MIB]);
        // Back under the outer guard: the inner one's 1 MiB is still held, 2 more fit.
        let more = vec![1u8; 2 * MIB];
        assert_eq!(kept.len() + more.len(), 3 * MIB);
    });
    // No guard: nothing is bounded.
    assert_eq!(vec![1u8; 32 * MIB].len(), 32 * MIB);
}

#[test]
fn a_panic_inside_a_guard_leaves_no_guard_armed() {
    // Room for the panic's own allocations (a backtrace, with RUST_BACKTRACE set).
    const LIMIT: usize = 256 * MIB;
    let caught = std::panic::catch_unwind(|| guarded(LIMIT, "the panicking work", || panic!("inside the guard")));
    assert!(caught.is_err());
    // The thread goes on with no bound: past the panicked guard's limit (zeroed: the system
    // maps it lazily, so the test takes no such memory).
    assert_eq!(std::hint::black_box(vec![0u8; 2 * LIMIT]).len(), 2 * LIMIT);
}
#[test]
fn passing_the_limit_stops_the_process_with_the_reason() {
    if std::env::var_os(CHILD).is_some() {
        guarded(8 * MIB, "the doubling string", || {
            let mut s = String::from("x");
            for _ in 0..40 {
                s = s.repeat(2);
            }
            std::hint::black_box(s);
        });
        return;
    }
    let me = std::env::current_exe().unwrap();
    let out = Command::new(me)
        .args(["--exact", "passing_the_limit_stops_the_process_with_the_reason", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the child passed the limit and went on: {stderr}");
    assert!(stderr.contains("folio: stopped: the doubling string took more than 8 MiB of memory"), "{stderr}");
}
