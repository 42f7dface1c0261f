//! The process's host-memory budget (`--host-budget`, the window's engine setting): one ledger
//! that every large host allocation of the engine takes its bytes from before it allocates —
//! the offloaded K/V tier, a context file's pages locked in place, MagicPIG's tables while
//! built and kept, the embedding table in page-locked memory — and that refuses, with what is
//! in use, an allocation the budget cannot hold.
//!
//! Why a ledger and not the global allocator: the large allocations are not heap allocations
//! (page-locked memory from the driver, anonymous and file maps), so an allocator sees none of
//! them; and a refusal must come before the allocation, as an error its caller words with what
//! to change (a refused heap allocation aborts the process). What the ledger does not hold —
//! the app's heap, the tokenizer, buffers of a few MiB — is read from the process's resident set
//! when a hold is asked for: *other* = resident − held (at least zero), and a hold of `n` bytes
//! is granted when other + held + n ≤ budget. Held bytes are taken as resident: the owners
//! touch (zero, lock or fill) their memory right after the hold. The measured peak resident set
//! ([`crate::host_memory::peak_rss`]) is what shows the budget held: the benchmarks fail a run
//! whose peak passed it.
//!
//! The default budget is what the machine can give this process when first asked (its
//! available memory plus the anonymous memory the process already holds — its file pages are
//! in the available memory already — and no more than its cgroup's limit, in a container) less
//! [`MARGIN`] for the system and the programs beside it. Where the platform gives no reading
//! the default is no cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Left to the system and other programs by the default budget: the larger of 2 GiB and this
/// fraction of the machine's memory (a desktop session, a browser, the page cache's floor).
pub const MARGIN_MIN: u64 = 2 << 30;
pub const MARGIN_FRACTION: f64 = 0.10;
/// Spelled out for the docs: the default margin is `max(MARGIN_MIN, MARGIN_FRACTION × total)`.
pub const MARGIN: &str = "the larger of 2 GiB and a tenth of the machine's memory";

/// The budget set for the process; [`UNSET`] until [`set_budget`], then the default applies.
static BUDGET: AtomicU64 = AtomicU64::new(UNSET);
const UNSET: u64 = 0;
/// Bytes held by live [`Hold`]s.
static HELD: AtomicU64 = AtomicU64::new(0);
/// The default, read once: later readings would count what the process took since as gone.
static DEFAULT: OnceLock<Option<u64>> = OnceLock::new();

/// Sets the process's budget in bytes; `None` returns to the default. Holds already granted
/// stay; later ones are held to the new budget.
pub fn set_budget(bytes: Option<u64>) {
    BUDGET.store(bytes.map_or(UNSET, |b| b.max(1)), Ordering::SeqCst);
}

/// The budget holds are granted within: the one set, else the default; `None`: no cap.
pub fn budget() -> Option<u64> {
    match BUDGET.load(Ordering::SeqCst) {
        UNSET => default_budget(),
        b => Some(b),
    }
}

/// Whether a budget was set (rather than the default).
pub fn is_set() -> bool {
    BUDGET.load(Ordering::SeqCst) != UNSET
}

/// What the machine can give this process, less the margin (see the module docs); `None`
/// where the platform says nothing.
pub fn default_budget() -> Option<u64> {
    *DEFAULT.get_or_init(|| {
        let (available, total) = (crate::host_memory::available()?, crate::host_memory::total()?);
        let own = crate::host_memory::anonymous().unwrap_or(0);
        let total = crate::host_memory::cgroup_limit().map_or(total, |l| l.min(total));
        let margin = MARGIN_MIN.max((total as f64 * MARGIN_FRACTION) as u64);
        Some((available + own).min(total).saturating_sub(margin).max(1))
    })
}

/// Bytes held now.
pub fn held() -> u64 {
    HELD.load(Ordering::SeqCst)
}

/// Bytes granted to one allocation, given back when dropped (keep it beside the memory).
#[derive(Debug)]
pub struct Hold {
    bytes: u64,
}

impl Hold {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        HELD.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// Memory kept beside its hold, as one owner (a context file's mapping, a map of rows shared
/// with a GPU): the bytes go back to the budget when the memory goes.
pub struct Held<T> {
    inner: T,
    _hold: Hold,
}

impl<T> Held<T> {
    pub fn new(inner: T, hold: Hold) -> Self {
        Self { inner, _hold: hold }
    }
}

impl<T: AsRef<[u8]>> AsRef<[u8]> for Held<T> {
    fn as_ref(&self) -> &[u8] {
        self.inner.as_ref()
    }
}

/// A hold the budget could not grant: what asked, and how the budget was spent.
#[derive(Debug, Clone)]
pub struct Refused {
    pub what: String,
    pub bytes: u64,
    pub budget: u64,
    /// Held by the engine's large allocations.
    pub held: u64,
    /// The rest of the process (resident − held).
    pub other: u64,
    /// Whether the budget is the default rather than one set.
    pub default: bool,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let free = self.budget.saturating_sub(self.held + self.other);
        write!(
            f,
            "{} needs {} of host memory, and the {}host budget of {} has {} left ({} held by the K/V tier, tables \
             and pinned buffers, {} by the rest of the process)",
            self.what,
            gib(self.bytes),
            if self.default { "default " } else { "" },
            gib(self.budget),
            gib(free),
            gib(self.held),
            gib(self.other)
        )
    }
}

impl std::error::Error for Refused {}

/// GiB with two decimals: budgets are set in GiB, and a refusal's figures add up in one unit.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes a hold could be granted now: the budget less what is held and the rest of the
/// process; `None` with no cap.
pub fn room() -> Option<u64> {
    let b = budget()?;
    let now = HELD.load(Ordering::SeqCst);
    let other = crate::host_memory::rss().unwrap_or(0).saturating_sub(now);
    Some(b.saturating_sub(now.saturating_add(other)))
}

/// Holds `bytes` for `what` (named in a refusal: "the offloaded K/V", …) when the budget has
/// room for them beside what is held and the rest of the process; else says why not.
pub fn hold(bytes: u64, what: &str) -> Result<Hold, Refused> {
    let budget = budget();
    let rss = || crate::host_memory::rss().unwrap_or(0);
    let mut now = HELD.load(Ordering::SeqCst);
    loop {
        if let Some(b) = budget {
            // The rest of the process, from the same count of held bytes as the check.
            let other = rss().saturating_sub(now);
            if now.saturating_add(other).saturating_add(bytes) > b {
                return Err(Refused { what: what.to_owned(), bytes, budget: b, held: now, other, default: !is_set() });
            }
        }
        match HELD.compare_exchange(now, now + bytes, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return Ok(Hold { bytes }),
            Err(actual) => now = actual,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds are granted up to the budget and given back when dropped; a refusal names what
    /// asked and adds up; the default returns when the budget is unset. (One test: the budget
    /// is the process's, and tests run on threads of one process.)
    #[test]
    fn holds_within_the_budget_and_refusals_add_up() {
        const MIB: u64 = 1 << 20;
        let rss = crate::host_memory::rss().unwrap_or(0);
        let start = held();
        set_budget(Some(rss + start + 256 * MIB));
        let a = hold(128 * MIB, "a").unwrap();
        // What the hold is for, resident: the rest of the process is what it was.
        let touched = vec![1u8; (128 * MIB) as usize];
        assert_eq!(held(), start + 128 * MIB);
        let refused = hold(192 * MIB, "the offloaded K/V").unwrap_err();
        assert_eq!((refused.bytes, refused.default), (192 * MIB, false));
        let text = refused.to_string();
        assert!(text.starts_with("the offloaded K/V needs 0.19 GiB of host memory, and the host budget"), "{text}");
        drop((a, std::hint::black_box(touched)));
        assert_eq!(held(), start);
        // What room says fits is granted, and more than it is not.
        let r = room().unwrap();
        assert!(r <= 256 * MIB && hold(r + 16 * MIB, "c").is_err(), "{r}");
        drop(hold(r.saturating_sub(16 * MIB), "d").unwrap());
        drop(hold(192 * MIB, "b").unwrap());
        set_budget(None);
        assert!(!is_set());
        if cfg!(target_os = "linux") {
            let d = default_budget().unwrap();
            assert_eq!(budget(), Some(d));
            assert!(hold(d + 1, "too much").is_err());
        }
    }
}
