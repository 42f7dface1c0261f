//! The kernels that belong to one attention method each: [`hip`] (HiP's hierarchical block
//! search: a round's steps, the whole search round by round, in one launch over host rows, and
//! one head's search on the CPU over host rows)
//! and [`magicpig`] (MagicPIG's LSH table walk and sample attention on the GPU, and the CPU's
//! attention of a sample straight from host memory).
//!
//! Why a crate of their own: folio-kernels holds the primitives any method is built from (top-k,
//! the gather of picked rows, attention with its log-sum-exp, host rows mapped for the device)
//! and knows no method; a method's own kernels sit here, named after it, so that the generic
//! crate stays generic and a method's kernels are found beside each other. The engine's
//! `attention` module calls both crates.
//!
//! Rules, the same as folio-kernels' (its crate docs): candle and folio-kernels only, nothing of
//! the models; every kernel has a plain-slice reference beside its fast path and a test holding
//! them together on fresh random inputs, with one test body for every device; a fast path never
//! reads outside its buffers, whatever positions it is given. The CUDA sources are in `cuda/`,
//! compiled by the kernels crate's build script (`build` in Cargo.toml) and sharing its
//! `select.cuh`.

pub mod hip;
pub mod magicpig;
