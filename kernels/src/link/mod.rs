//! A slower host link, emulated (`--link-gbps`): so that the GPU machine (a 55 GB/s link) can
//! be run as a consumer card (PCIe 4.0 x16, ~25 GB/s) and a decode step over the offloaded
//! tier measured end to end instead of projected.
//!
//! How: every kernel that reads host memory over the link — the gather of picked rows (and of
//! the embedding table's), HiP's block search, MagicPIG's table walk and sample attention — is
//! launched through [`paced`] on its stream. With a rate set, a one-thread kernel notes when
//! the reader starts, and another after it holds the stream until the reader's bytes would have
//! crossed the emulated link: from the reader's start, or from when the link finished the reads
//! before it (one link per GPU, shared by its streams), whichever is later; the wait spins on
//! the GPU's global timer, so nothing on the host waits and launches overlap as they would.
//! The bytes are the host's count where it knows them (a gather's rows, a search's keys) plus
//! what the reader adds on the device where only the device knows (MagicPIG's sample, the
//! walk's runs), through the counter address [`paced`] hands the launch.
//!
//! Rejected: sleeping on the host after each copy (decode's reads are kernels, not copies, and
//! a host wait would serialise what the GPU overlaps); throttling only the copy engine's
//! copies (the offloaded tier reads host memory with zero-copy kernels). Not paced: the staged
//! copies of folio-runtime (a prefill's K/V leaving the device, a resident layer decoded from
//! the file), which no decode step over the offloaded tier makes.
//!
//! Without a rate, or on the CPU (no link), [`paced`] is the launch itself.

use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::paced;

/// The emulated rate's f64 bits, bytes/s; 0: the link as it is.
static RATE: AtomicU64 = AtomicU64::new(0);

/// Emulates a host link of `bytes_per_s` from now on (process-wide); `None`: the link as it is.
pub fn set_rate(bytes_per_s: Option<f64>) {
    let bits = bytes_per_s.filter(|r| r.is_finite() && *r > 0.0).map_or(0, f64::to_bits);
    RATE.store(bits, Ordering::SeqCst);
}

/// The emulated rate, bytes/s, when one is set.
pub fn rate() -> Option<f64> {
    match RATE.load(Ordering::SeqCst) {
        0 => None,
        bits => Some(f64::from_bits(bits)),
    }
}

#[cfg(test)]
mod tests {
    /// A rate is set and cleared; a rate that is no rate (zero, negative, not finite) clears it.
    #[test]
    fn rates_are_set_and_cleared() {
        super::set_rate(Some(25e9));
        assert_eq!(super::rate(), Some(25e9));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            super::set_rate(Some(25e9));
            super::set_rate(Some(bad));
            assert_eq!(super::rate(), None, "{bad}");
        }
        super::set_rate(None);
        assert_eq!(super::rate(), None);
    }
}
