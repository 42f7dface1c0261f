//! Attention math for Folio, with no knowledge of models — and the few other device primitives
//! a prefill needs fused or moved (the K/V codec in [`encode`], the MLP's activation in [`mlp`],
//! RMSNorm in [`norm`], projections to heads and back in [`heads`], a greedy step's token in
//! [`argmax`], a decode step's projections in [`gemv`]), held to the same rules
//! (copies between host and device, and the device's memory readings, are folio-runtime's). An attention *method's*
//! own kernels (HiP's block search, MagicPIG's LSH sample and CPU attention) live in
//! folio-method-kernels, over the host rows and mapped memory of [`select`].
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

pub mod argmax;
pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda_op;
pub mod encode;
pub mod gemv;
pub mod heads;
mod layout;
pub mod link;
pub mod mlp;
pub mod norm;
pub mod quant;
pub mod select;
pub mod sparse;

pub use attention::{attention, attention_block, merge, AttnOutput, FlashKernel, Mask};
pub use layout::Positions;
