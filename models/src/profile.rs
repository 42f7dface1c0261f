//! Where a prefill's or a decode step's time goes, op by op, when asked (`folio bench prefill
//! --profile`, `folio bench --shape --profile`).
//!
//! GPU work is asynchronous: a stage timed on the host only measures its launches, and the
//! next operation that waits for the device (a copy to the host) is charged for everything
//! queued before it. A profiled run therefore synchronises the device around each span and
//! charges the span with its own work only; that costs a little speed, so it is off unless a
//! run asks for it, and then only on the thread that asked (the prefill's).
//!
//! Rejected: CUDA events per span (no host stall, but every span would need candle's stream at
//! its call site and a pass reading the events back; the stall only costs a profiled run); nsys (not on every machine this runs on, and
//! its report is not a figure a benchmark can print beside its others).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use candle_core::Device;

use crate::error::Result;

thread_local! {
    static SPANS: RefCell<Option<BTreeMap<&'static str, (Duration, usize)>>> = const { RefCell::new(None) };
    static SYNC: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// What a span's time is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// Its own work: the device synchronised before and after, so the span's wall time is its
    /// launches and its device work, and nothing queued before it.
    Device,
    /// The host's time queueing it, nothing synchronised: where a step is bound by its
    /// launches (a decode step's ~30 small operations a layer), this is what the step costs.
    Host,
}

/// Starts recording spans on this thread (clearing what was recorded), timed by `clock`.
pub fn start(clock: Clock) {
    SYNC.with(|s| s.set(clock == Clock::Device));
    SPANS.with(|s| *s.borrow_mut() = Some(BTreeMap::new()));
}

/// Each span's name, total seconds and calls, longest first.
pub type Spans = Vec<(&'static str, f64, usize)>;

/// Spans named `outer: part` run inside the span `outer` (an attention call's gather, say):
/// their time is also the outer span's, so a reader summing spans skips them.
pub fn is_part(name: &str) -> bool {
    name.contains(": ")
}

/// Stops recording and returns the spans.
pub fn finish() -> Spans {
    let spans = SPANS.with(|s| s.borrow_mut().take()).unwrap_or_default();
    let mut out: Vec<_> = spans.into_iter().map(|(name, (d, n))| (name, d.as_secs_f64(), n)).collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

fn recording() -> bool {
    SPANS.with(|s| s.borrow().is_some())
}

/// Whether this thread's spans synchronise the device now ([`Clock::Device`] recording): what
/// runs at once otherwise runs in turn, so timings taken meanwhile say nothing of a step.
pub fn synchronising() -> bool {
    recording() && SYNC.with(|s| s.get())
}

/// Runs `f`, charging its time on `device` to `name` when this thread is recording (with
/// [`Clock::Device`] the device is synchronised before and after, so the span holds its own
/// work only).
pub fn span<T>(device: &Device, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !recording() {
        return f();
    }
    let sync = SYNC.with(|s| s.get());
    if sync {
        device.synchronize()?;
    }
    let started = Instant::now();
    let out = f()?;
    if sync {
        device.synchronize()?;
    }
    charge(name, started.elapsed());
    Ok(out)
}

/// Charges `took` to span `name` as one call, when this thread is recording: for work timed
/// where it ran (tasks on a thread pool, whose sum the caller scales to what it cost the step).
pub fn charge(name: &'static str, took: Duration) {
    SPANS.with(|s| {
        if let Some(map) = s.borrow_mut().as_mut() {
            let e = map.entry(name).or_default();
            e.0 += took;
            e.1 += 1;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock a recording starts with decides whether spans synchronise; spans are charged
    /// by name with their calls, and nothing is recorded once finished.
    #[test]
    fn clock_and_spans() {
        for (clock, sync) in [(Clock::Host, false), (Clock::Device, true)] {
            start(clock);
            assert_eq!(SYNC.with(|s| s.get()), sync);
            for _ in 0..3 {
                span(&Device::Cpu, "a", || {
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                })
                .unwrap();
            }
            span(&Device::Cpu, "b", || Ok(())).unwrap();
            charge("b", Duration::from_micros(10));
            let spans = finish();
            assert_eq!(spans.iter().map(|s| (s.0, s.2)).collect::<Vec<_>>(), [("a", 3), ("b", 2)]);
            assert!(spans[0].1 >= 0.003 && spans[1].1 >= 1e-5, "{spans:?}");
        }
        span(&Device::Cpu, "c", || Ok(())).unwrap();
        charge("c", Duration::from_millis(1));
        assert!(finish().is_empty());
    }
}
