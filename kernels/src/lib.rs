//! Attention math for Folio, with no knowledge of models — and the few other device primitives
//! a prefill needs fused or moved (the K/V codec in [`encode`], the MLP's activation in [`mlp`],
//! RMSNorm in [`norm`], projections to heads and back in [`heads`], staged host copies and
//! hand-offs between threads in [`device`], a hierarchical block search's steps in [`blocks`]),
//! held to the same rules.
//!
//! Rules of this crate (docs/architecture.md):
//!
//! * it depends on candle (tensors, devices) and nothing of Folio's: no model config, no
//!   tokens, no files, no attention *method* — only the primitives methods are built from;
//! * every primitive has a reference beside its fast path, and a test compares them on fresh
//!   random inputs with one body for every device;
//! * a fast path never reads outside its buffers, whatever positions it is given.
//!
//! Every primitive exists twice, side by side:
//!
//! * a **reference** over plain `f32` slices, written as directly from the definition as
//!   possible (two passes, no tricks), whose only job is to be obviously right;
//! * a **fast path** over candle tensors that runs on every device candle supports (CPU, and
//!   CUDA with the `cuda` feature) and is what the engine calls.
//!
//! The tests compare the two on fresh random inputs with one test body for every device
//! (candle's `test_device!` habit), so a later hand-written CUDA kernel slots in beside the
//! candle path and is held to the same reference.
//!
//! Attention here always returns the log-sum-exp (LSE) of each query's scores along with the
//! output: sparse methods compute partial attentions over disjoint key sets and merge them
//! exactly by LSE, so the primitive has to expose it from day one.

pub mod attention;
pub mod blocks;
#[cfg(feature = "cuda")]
mod cuda_op;
pub mod device;
pub mod encode;
pub mod heads;
pub mod mlp;
pub mod norm;
pub mod select;
pub mod sparse;

pub use attention::{attention, attention_block, merge, AttnOutput, FlashKernel, Mask};

/// Whether a gathering kernel checks its positions against the stored rows before it runs.
/// On a GPU the check is a reduction and a device synchronisation per call, which a decode
/// step cannot afford a hundred times over; positions the caller's own selection produced
/// (top-k over a score row, a window, an arange) are `Trusted`. The kernels clamp every
/// position either way, so a wrong one reads a wrong row, never memory outside the buffer.
/// On the CPU the check is free and always made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions {
    Check,
    Trusted,
}

/// `t` contiguous and starting on a 16-byte boundary of its buffer (for 2- and 4-byte dtypes):
/// the kernels read rows with 16-byte loads, so a view starting mid-vector is copied first,
/// into a buffer of its own (candle's `Tensor::copy` clones the whole buffer and keeps the
/// view's offset, which left such a view misaligned).
#[cfg(feature = "cuda")]
pub(crate) fn vector_aligned(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() % 8 == 0 {
        return Ok(t);
    }
    let flat = t.flatten_all()?;
    let fresh = candle_core::Tensor::zeros(flat.elem_count(), t.dtype(), t.device())?;
    fresh.slice_set(&flat, 0, 0)?;
    fresh.reshape(t.shape())
}
