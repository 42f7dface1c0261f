//! Sparse-decode primitives: attention over the rows a step picked, the attention mass each
//! row received, and SimHash codes.
//!
//! Each has a [`reference`] over plain slices (f64 sums, straight from the definition) and a
//! fast path over candle tensors: the reference itself on the CPU (the sparse methods' CPU
//! work is already per-row loops), hand-written kernels (kernels/cuda/sparse.cu, compiled to
//! PTX by build.rs) on CUDA. The attention kernel takes rows already gathered (a method's
//! pick, a cache's live rows) and serves up to 8 query heads of a GQA group per block, so each
//! row is read once per KV head (per 8 query heads), not once per query head: a logits kernel
//! (a thread a row), a value kernel split over about a thousand blocks of at least 128 rows,
//! and a merge of their partials by LSE (kernels/cuda/sparse.cu says why three simple kernels
//! rather than one tiled one). An earlier kernel gathered each query head's positions itself:
//! every fast path handed it rows already gathered, so it read them once per query head for
//! nothing (BUZZ's 105k live rows a layer at 1M tokens: with the mass, 13.0 ms of a 21.4 ms
//! step on an H100, synchronised profile).
//! SimHash sums each projection in f32 in channel order, as its reference does, so codes agree
//! bit for bit across devices (a GEMM would round differently and flip the sign of near-zero
//! projections: an index built on the GPU would sample other keys than the CPU's).
//!
//! Costs, for the benchmarks' ratio to the hardware limit (per call; `h` query heads, `g` KV
//! heads, `s` rows per KV head, `d` head dim, `b` bytes per K/V element):
//! * decode attention: 4·h·s·d FLOPs, g·s·2·d·b bytes read once per 8 query heads of a group
//!   (+4·h·s with a bias, and 8·h·s for the logits written and read back) — bandwidth-bound,
//!   so its limit is memory bandwidth;
//! * attention mass: 2·h·s·d FLOPs, g·s·d·b bytes read;
//! * SimHash codes: 2·r·d·K·L FLOPs, r·d·4 + d·K·L·4 + r·L·4 bytes — compute-bound for the
//!   paper's K·L = 1500.

use candle_core::{DType, Device, Result, Tensor};

use rayon::prelude::*;

/// Most hash bits per table a code may hold (a cap of this API, well above MagicPIG's K ≤ 12;
/// a u32 code holds 32).
pub const MAX_SIMHASH_BITS: usize = 16;

/// The plain-slice definitions the fast paths are held to.
pub mod reference;

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()
}

/// Attention of each query head over the first `rows` rows of its KV head, the same rows for
/// every head of a group: `q [heads, d]`, `k`, `v` `[kv_heads, n, d]` (f32 or bf16, `rows ≤
/// n`), `bias [heads, rows]` f32 or none: [`reference::decode_attention`] with every head
/// selecting `0..rows`. On CUDA each K and V row is read once per KV group, not once per query
/// head: the kernel for a pick (gathered into contiguous rows, per query head or shared by a
/// group), a cache's live slots, a resident layer. bf16 queries over bf16 rows without a bias
/// (the model's decode on a GPU) run on tensor cores there, the group's heads as the rows of one
/// product, with the softmax weights rounded to bf16 as the prefill kernels round them (head
/// dims 32, 64 and 128; others take the CUDA-core kernels). Returns `(out [heads, d] f32, lse
/// [heads] f32)`.
pub fn decode_attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: usize,
    bias: Option<&Tensor>,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (heads, d) = q.dims2()?;
    let (kv_heads, n, kd) = k.dims3()?;
    if kd != d || v.dims() != k.dims() || kv_heads == 0 || heads % kv_heads != 0 || rows > n {
        candle_core::bail!("decode_attention_rows: q {:?} k {:?} v {:?}, {rows} rows", q.dims(), k.dims(), v.dims());
    }
    if let Some(b) = bias.filter(|b| b.dims() != [heads, rows]) {
        candle_core::bail!("decode_attention_rows: bias {:?} for {heads} heads over {rows} rows", b.dims());
    }
    match q.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::decode_attention_rows(q, k, v, bias, (heads, kv_heads, n, d, rows), scale),
        device => {
            let idx: Vec<u32> = (0..heads).flat_map(|_| 0..rows as u32).collect();
            let bias_v = bias.map(f32s).transpose()?;
            let (out, lse) = reference::decode_attention(
                &f32s(q)?,
                &f32s(k)?,
                &f32s(v)?,
                &idx,
                bias_v.as_deref(),
                (heads, kv_heads, n, d),
                scale,
            );
            Ok((Tensor::from_vec(out, (heads, d), device)?, Tensor::from_vec(lse, heads, device)?))
        }
    }
}

/// Whether [`decode_attention_rows`] runs on tensor cores for `dtype` queries and rows of head
/// dim `d` without a bias on `device` (a caller choosing between it and another path by cost).
pub fn rows_on_tensor_cores(device: &Device, dtype: DType, d: usize) -> bool {
    #[cfg(feature = "cuda")]
    return device.is_cuda() && dtype == DType::BF16 && cuda::MMA_DIMS.contains(&d);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, d);
        false
    }
}

/// The attention mass of the first `rows` keys of each KV head in one decode step (BUZZ's
/// heavy-hitter scores; see [`reference::attention_mass`]): `q [heads, d]`, `k [kv_heads, n, d]`
/// (f32 or bf16), `lse [heads]` f32 as [`decode_attention_rows`] returned it for these keys, and
/// the sums so far `prev [kv_heads, p]` (`p ≤ rows`, zero past `p`) or none. Returns
/// `[kv_heads, rows]` f32: K is read once per KV group, V not at all.
pub fn attention_mass(
    q: &Tensor,
    k: &Tensor,
    lse: &Tensor,
    prev: Option<&Tensor>,
    rows: usize,
    scale: f32,
) -> Result<Tensor> {
    let (heads, d) = q.dims2()?;
    let (kv_heads, n, kd) = k.dims3()?;
    let prev_width = prev.map(|p| p.dims2()).transpose()?;
    if kd != d
        || lse.dims() != [heads]
        || kv_heads == 0
        || heads % kv_heads != 0
        || rows > n
        || prev_width.is_some_and(|(g, p)| g != kv_heads || p > rows)
    {
        candle_core::bail!(
            "attention_mass: q {:?}, k {:?}, lse {:?}, prev {:?}, {rows} rows",
            q.dims(),
            k.dims(),
            lse.dims(),
            prev.map(Tensor::dims)
        );
    }
    match q.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::attention_mass(q, k, lse, prev, (heads, kv_heads, n, d), rows, scale),
        device => {
            let prev_v = prev.map(f32s).transpose()?;
            let out = reference::attention_mass(
                &f32s(q)?,
                &f32s(k)?,
                &f32s(lse)?,
                prev_v.as_deref().zip(prev_width.map(|(_, p)| p)),
                (heads, kv_heads, n, d),
                rows,
                scale,
            );
            Tensor::from_vec(out, (kv_heads, rows), device)
        }
    }
}

/// Label scores `[heads, n]` (see [`reference::label_scores`]): `ql [heads, r]` f32, `codes
/// [kv_heads, n, r]` u8, `scale [kv_heads, n, 2]` f32.
pub fn label_scores(ql: &Tensor, codes: &Tensor, scale: &Tensor, bits: usize) -> Result<Tensor> {
    let (heads, r) = ql.dims2()?;
    let (kv_heads, n, cr) = codes.dims3()?;
    if cr != r || scale.dims() != [kv_heads, n, 2] || kv_heads == 0 || heads % kv_heads != 0 || !(1..=8).contains(&bits)
    {
        candle_core::bail!(
            "label_scores: ql {:?}, codes {:?}, scale {:?}, {bits} bits",
            ql.dims(),
            codes.dims(),
            scale.dims()
        );
    }
    match ql.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::label_scores(ql, codes, scale, (heads, kv_heads, n, r), bits),
        device => {
            let codes_v: Vec<u8> = codes.flatten_all()?.to_vec1()?;
            let out = reference::label_scores(&f32s(ql)?, &codes_v, &f32s(scale)?, (heads, kv_heads, n, r), bits);
            Tensor::from_vec(out, (heads, n), device)
        }
    }
}

/// Rows per task of the CPU SimHash: enough to amortise the task, few enough to spread an
/// index build's chunk over every core.
const SIMHASH_ROWS_PER_TASK: usize = 256;

/// SimHash codes `[rows, tables]` u32 of `x [rows, d]` against `w [d, bits·tables]` (f32), bit
/// for bit [`reference::simhash_codes`] on every device: on the CPU the reference over the
/// cores, on CUDA a kernel summing in the same order without fused multiply-adds.
pub fn simhash_codes(x: &Tensor, w: &Tensor, bits: usize, tables: usize) -> Result<Tensor> {
    let (rows, d) = x.dims2()?;
    if w.dims() != [d, bits * tables] || bits == 0 || bits > MAX_SIMHASH_BITS || tables == 0 {
        candle_core::bail!("simhash_codes: x {:?}, w {:?}, {bits} bits x {tables} tables", x.dims(), w.dims());
    }
    if rows == 0 {
        return Tensor::zeros((0, tables), DType::U32, x.device());
    }
    match x.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::simhash_codes(x, w, (rows, d, bits, tables)),
        device => {
            let (x, w) = (f32s(x)?, f32s(w)?);
            let codes: Vec<u32> = x
                .par_chunks(SIMHASH_ROWS_PER_TASK * d.max(1))
                .flat_map_iter(|rows| reference::simhash_codes(rows, &w, d, bits, tables))
                .collect();
            Tensor::from_vec(codes, (rows, tables), device)
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::merge_partials;
