//! Launching the kernels of kernels/cuda/sparse.cu through candle's CUDA device: each is a
//! `CustomOp` whose extra inputs ride in the op, so the output is an ordinary tensor.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda::CudaDevice;
use candle_core::cuda::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use crate::cuda_op::{cuda_storage, CudaOnly, CudaOp2, CudaOp3};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sparse.ptx"));
const MODULE: &str = "folio_sparse";
/// Threads per block of the decode kernels (TILE in the kernel) and of the kernels with a
/// thread per item (`grid_for`).
const DECODE_THREADS: u32 = 128;
const HASH_THREADS: u32 = 256;
/// Value-kernel blocks aimed for (a few per SM of a large GPU, so the row loads in flight
/// cover the memory latency; at most MAX_CHUNKS a head, the merge's limit), and the fewest rows
/// a block takes.
const TARGET_BLOCKS: usize = 1024;
const MIN_ROWS_PER_BLOCK: usize = 128;
/// Largest head dim the kernels hold in shared memory and registers (MAX_D in the kernel).
const MAX_D: usize = 256;
/// Query heads a decode block serves at once (GROUP_BLOCK in the kernel), the logits kernel's
/// rows per block (a row per thread: LOGIT_THREADS), and the channels a thread of the value
/// kernel takes (VALUE_CHANNELS).
const GROUP_BLOCK: usize = 8;
const LOGIT_THREADS: usize = 128;
const VALUE_CHANNELS: usize = 8;
/// Channels a block of the merge takes (MERGE_CHANNELS in the kernel).
const MERGE_CHANNELS: usize = 32;

/// Merges `part`'s `heads × chunks` partials (d + 2 floats each) into each head's output and
/// LSE, `[heads · d + heads]`.
pub fn merge_partials(
    dev: &CudaDevice,
    part: CudaSlice<f32>,
    heads: usize,
    chunks: usize,
    d: usize,
) -> Result<(CudaStorage, Shape)> {
    // SAFETY: the merge writes every output row and LSE.
    let out = unsafe { dev.alloc::<f32>(heads * d + heads)? };
    {
        let (out_o, out_l) = (out.slice(..heads * d), out.slice(heads * d..));
        let func = dev.get_or_load_custom_func("decode_attention_merge", MODULE, PTX)?;
        let mut b = func.builder();
        let (chunks, d) = (chunks as i32, d as i32);
        b.arg(&part).arg(&out_o).arg(&out_l).arg(&chunks).arg(&d);
        let cfg = LaunchConfig {
            grid_dim: (heads as u32, (d as usize).div_ceil(MERGE_CHANNELS) as u32, 1),
            block_dim: (DECODE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: part holds heads × chunks partials of d + 2 floats.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(heads * d + heads)))
}

struct DecodeRows {
    bias: Option<Tensor>,
    dims: (usize, usize, usize, usize, usize),
    scale: f32,
}

impl CudaOp3 for DecodeRows {
    const NAME: &'static str = "folio-decode-attention-rows";

    fn cuda_fwd(&self, [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
        let (heads, kv_heads, n, d, rows) = self.dims;
        // A block per (KV head, chunk, GROUP_BLOCK query heads of the group).
        let blocks_z = (heads / kv_heads).div_ceil(GROUP_BLOCK);
        let chunks = rows.div_ceil(MIN_ROWS_PER_BLOCK).min(TARGET_BLOCKS.div_ceil(kv_heads * blocks_z)).max(1);
        let rows_per_block = rows.div_ceil(chunks).max(1);
        let dev = q.device().clone();
        let bias_guard = self.bias.as_ref().map(|b| b.storage_and_layout());
        let bias = match &bias_guard {
            Some((s, l)) => Some(cuda_storage(s, "bias")?.as_cuda_slice::<f32>()?.slice(l.start_offset()..)),
            None => None,
        };
        let null: u64 = 0;
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        // SAFETY: the logits kernel writes every head's logit of every row, and each head's
        // maximum of each of its blocks.
        let z = unsafe { dev.alloc::<f32>((heads * rows).max(1))? };
        let row_blocks = rows.div_ceil(LOGIT_THREADS).max(1);
        let bmax = unsafe { dev.alloc::<f32>(heads * row_blocks)? };
        // SAFETY: every block writes its chunk's partial for each head it serves.
        let part = unsafe { dev.alloc::<f32>(heads * chunks * (d + 2))? };
        let Ok(row_blocks) = u32::try_from(row_blocks) else {
            candle_core::bail!("decode_attention_rows: {rows} rows are more than one launch holds");
        };
        let logits_cfg = LaunchConfig {
            grid_dim: (row_blocks, kv_heads as u32, 1),
            block_dim: (LOGIT_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let values_cfg = LaunchConfig {
            grid_dim: (kv_heads as u32, chunks as u32, blocks_z as u32),
            block_dim: (DECODE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [heads as i32, kv_heads as i32, n as i32, d as i32, rows as i32];
        macro_rules! launch {
            ($t:ty, $logits:literal, $values:literal) => {{
                let ks = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                let vs = v.as_cuda_slice::<$t>()?.slice(vl.start_offset()..);
                let func = dev.get_or_load_custom_func($logits, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&qs).arg(&ks);
                match &bias {
                    Some(bias) => b.arg(bias),
                    None => b.arg(&null),
                };
                b.arg(&z).arg(&bmax);
                for x in &dims {
                    b.arg(x);
                }
                b.arg(&self.scale);
                // SAFETY: shapes checked by the caller (rows ≤ n, the head dim within the
                // kernel's shared queries); z holds heads × rows.
                unsafe { b.launch(logits_cfg) }.w()?;
                let func = dev.get_or_load_custom_func($values, MODULE, PTX)?;
                let mut b = func.builder();
                let rows_per_block = rows_per_block as i32;
                b.arg(&z).arg(&bmax).arg(&vs).arg(&part);
                for x in &dims {
                    b.arg(x);
                }
                b.arg(&rows_per_block);
                // SAFETY: as above; part holds heads × chunks partials of d + 2 floats, and the
                // channel groups fit a block (checked by the caller).
                unsafe { b.launch(values_cfg) }.w()?;
            }};
        }
        match k.dtype() {
            DType::F32 => launch!(f32, "decode_rows_logits_f32", "decode_rows_values_f32"),
            DType::BF16 => launch!(half::bf16, "decode_rows_logits_bf16", "decode_rows_values_bf16"),
            other => candle_core::bail!("decode_attention_rows: K/V must be f32 or bf16, not {other:?}"),
        }
        merge_partials(&dev, part, heads, chunks, d)
    }
}

/// Head dims decode_rows_mma is compiled for; its warps (DECODE_WARPS in the kernel), rows per
/// tile (DECODE_KEYS) and bf16 of padding per shared-memory row (DECODE_PAD).
pub(super) const MMA_DIMS: [usize; 3] = [32, 64, 128];
const MMA_WARPS: u32 = 4;
const MMA_KEYS: usize = 64;
const MMA_PAD: usize = 8;
/// Fewest rows a decode_rows_mma block takes (two tiles), and the blocks aimed for: one wave of
/// a large GPU at the three blocks an SM holds (their shared memory), 132 SMs on an H100. On an
/// H100 fewer, longer blocks measured better for many rows (97 µs over 105k rows with 512-row
/// blocks, 107 µs with 128), more, shorter ones for few (13 µs over 2048 rows with 128-row
/// blocks, 24 µs with 512): docs/performance.md.
const MMA_MIN_ROWS: usize = 128;
const MMA_TARGET_BLOCKS: usize = 396;
/// Shared memory a block may use without asking for more.
const DEFAULT_SHARED: usize = 48 << 10;

/// decode_rows_mma's launch: bf16 queries and rows, no bias.
struct DecodeRowsMma {
    dims: (usize, usize, usize, usize, usize),
    scale: f32,
}

impl CudaOp3 for DecodeRowsMma {
    const NAME: &'static str = "folio-decode-rows-mma";

    fn cuda_fwd(&self, [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
        let (heads, kv_heads, n, d, rows) = self.dims;
        let head_blocks = (heads / kv_heads).div_ceil(16);
        let chunks = rows.div_ceil(MMA_MIN_ROWS).min(MMA_TARGET_BLOCKS.div_ceil(kv_heads * head_blocks)).max(1);
        let rows_per_block = rows.div_ceil(chunks).next_multiple_of(MMA_KEYS).max(MMA_KEYS);
        let chunks = rows.div_ceil(rows_per_block).max(1);
        let dev = q.device().clone();
        let qs = q.as_cuda_slice::<half::bf16>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<half::bf16>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<half::bf16>()?.slice(vl.start_offset()..);
        // SAFETY: every block writes its chunk's partial for each head of its group.
        let part = unsafe { dev.alloc::<f32>(heads * chunks * (d + 2))? };
        // Two stages of K and V tiles, reused at the end for the warps' states.
        let tiles = 2 * 2 * MMA_KEYS * (d + MMA_PAD) * 2;
        let states = (MMA_WARPS as usize * 16 * (d + 2)) * 4;
        let shared = tiles.max(states);
        let func = dev.get_or_load_custom_func(&format!("decode_rows_mma_{d}"), MODULE, PTX)?;
        if shared > DEFAULT_SHARED {
            let attr = candle_core::cuda::cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            func.set_attribute(attr, shared as i32).w()?;
        }
        let cfg = LaunchConfig {
            grid_dim: ((kv_heads * head_blocks) as u32, chunks as u32, 1),
            block_dim: (32 * MMA_WARPS, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let ints = [heads as i32, kv_heads as i32, n as i32, rows as i32, rows_per_block as i32];
        let mut b = func.builder();
        b.arg(&qs).arg(&ks).arg(&vs).arg(&part);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&self.scale);
        // SAFETY: shapes checked by the caller (rows ≤ n, d one of MMA_DIMS, K/V rows 16-byte
        // aligned); part holds heads × chunks partials of d + 2 floats.
        unsafe { b.launch(cfg) }.w()?;
        merge_partials(&dev, part, heads, chunks, d)
    }
}

/// `decode_attention_rows`: see [`super::decode_attention_rows`].
pub fn decode_attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    dims: (usize, usize, usize, usize, usize),
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (heads, d) = (dims.0, dims.3);
    // The value kernel spreads a row over a block's threads, VALUE_CHANNELS channels a thread
    // (one channel when d is not a multiple of it).
    if d > MAX_D || (d % VALUE_CHANNELS != 0 && d > DECODE_THREADS as usize) {
        candle_core::bail!(
            "decode_attention_rows: head dim {d} (at most {MAX_D}, and a multiple of {VALUE_CHANNELS} past {DECODE_THREADS})"
        );
    }
    let bf16 = [q, k, v].iter().all(|t| t.dtype() == DType::BF16);
    if bias.is_none() && bf16 && MMA_DIMS.contains(&d) {
        let op = DecodeRowsMma { dims, scale };
        let both = crate::layout::vector_aligned(q)?.apply_op3_no_bwd(
            &crate::layout::vector_aligned(k)?,
            &crate::layout::vector_aligned(v)?,
            &CudaOnly(op),
        )?;
        return Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?));
    }
    let bias = bias.map(|b| b.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let op = DecodeRows { bias, dims, scale };
    let both = q.to_dtype(DType::F32)?.contiguous()?.apply_op3_no_bwd(
        &crate::layout::vector_aligned(k)?,
        &crate::layout::vector_aligned(v)?,
        &CudaOnly(op),
    )?;
    Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?))
}

/// Threads per block of attention_mass (MASS_THREADS in the kernel: a row per thread).
const MASS_THREADS: usize = 128;

struct AttentionMass {
    prev: Option<Tensor>,
    dims: (usize, usize, usize, usize),
    rows: usize,
    scale: f32,
}

impl CudaOp3 for AttentionMass {
    const NAME: &'static str = "folio-attention-mass";

    fn cuda_fwd(&self, [(q, ql), (k, kl), (lse, ll)]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
        let (heads, kv_heads, n, d) = self.dims;
        let rows = self.rows;
        let dev = q.device().clone();
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let ls = lse.as_cuda_slice::<f32>()?.slice(ll.start_offset()..);
        let prev_guard = self.prev.as_ref().map(|p| p.storage_and_layout());
        let prev = match &prev_guard {
            Some((s, l)) => Some(cuda_storage(s, "prev")?.as_cuda_slice::<f32>()?.slice(l.start_offset()..)),
            None => None,
        };
        let prev_width = self.prev.as_ref().map_or(Ok(0), |p| p.dim(1))?;
        // SAFETY: one thread writes each (KV head, row).
        let out = unsafe { dev.alloc::<f32>((kv_heads * rows).max(1))? };
        let Ok(blocks) = u32::try_from(rows.div_ceil(MASS_THREADS)) else {
            candle_core::bail!("attention_mass: {rows} rows are more than one launch holds");
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks.max(1), kv_heads as u32, 1),
            block_dim: (MASS_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let null: u64 = 0;
        let ints = [heads as i32, kv_heads as i32, n as i32, d as i32, rows as i32, prev_width as i32];
        macro_rules! launch {
            ($t:ty, $name:literal) => {{
                let ks = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&qs).arg(&ks).arg(&ls);
                match &prev {
                    Some(prev) => b.arg(prev),
                    None => b.arg(&null),
                };
                b.arg(&out);
                for x in &ints {
                    b.arg(x);
                }
                b.arg(&self.scale);
                // SAFETY: shapes checked by the caller (rows ≤ n, prev_width ≤ rows, the group
                // and head dim within the kernel's shared arrays).
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match k.dtype() {
            DType::F32 => launch!(f32, "attention_mass_f32"),
            DType::BF16 => launch!(half::bf16, "attention_mass_bf16"),
            other => candle_core::bail!("attention_mass: K must be f32 or bf16, not {other:?}"),
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((kv_heads, rows))))
    }
}

pub fn attention_mass(
    q: &Tensor,
    k: &Tensor,
    lse: &Tensor,
    prev: Option<&Tensor>,
    dims: (usize, usize, usize, usize),
    rows: usize,
    scale: f32,
) -> Result<Tensor> {
    let d = dims.3;
    if d > MAX_D {
        candle_core::bail!("attention_mass: head dim {d} > {MAX_D}");
    }
    let prev = prev.map(|p| p.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let op = AttentionMass { prev, dims, rows, scale };
    q.to_dtype(DType::F32)?.contiguous()?.apply_op3_no_bwd(
        &crate::layout::vector_aligned(k)?,
        &lse.to_dtype(DType::F32)?.contiguous()?,
        &CudaOnly(op),
    )
}

/// Threads of a SimHash block: rows × tables (SH_ROWS and SH_TABLES in the kernel).
const SH_ROWS: usize = 32;
const SH_TABLES: usize = 8;

/// Blocks below which a SimHash launch splits each code's bits over blocks of their own (about
/// the multiprocessors of a large GPU). A decode step hashes a query head a row: 28 rows of 66
/// tables (MagicPIG at 2048 of 1M keys) fill 9 blocks, whose threads each summed 10 projections of 128 dependent adds one
/// after another, 28.8 µs a layer on an H200; a table's bits in blocks apart take one
/// projection's time. An index build (a million rows) fills thousands and stays whole.
const SH_SPLIT_BELOW: usize = 128;

struct SimHash {
    dims: (usize, usize, usize, usize),
}

impl CudaOp2 for SimHash {
    const NAME: &'static str = "folio-simhash";

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, d, bits, tables) = self.dims;
        let dev = x.device().clone();
        let xs = x.as_cuda_slice::<f32>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<f32>()?.slice(wl.start_offset()..);
        let (Ok(gx), Ok(gy)) = (u32::try_from(rows.div_ceil(SH_ROWS)), u32::try_from(tables.div_ceil(SH_TABLES)))
        else {
            candle_core::bail!("simhash_codes: {rows} rows are more than one launch holds");
        };
        // Bits a block computes; a split launch ORs its share into zeroed codes.
        let blocks = gx as usize * gy as usize;
        let per = if blocks < SH_SPLIT_BELOW { 1 } else { bits.max(1) };
        let codes = if per < bits {
            dev.alloc_zeros::<u32>(rows * tables)?
        } else {
            // SAFETY: one thread writes each code.
            unsafe { dev.alloc::<u32>(rows * tables)? }
        };
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, bits.div_ceil(per).max(1) as u32),
            block_dim: (SH_ROWS as u32, SH_TABLES as u32, 1),
            shared_mem_bytes: (SH_ROWS * (d + 1) * 4) as u32,
        };
        let func = dev.get_or_load_custom_func("simhash_codes", MODULE, PTX)?;
        let mut b = func.builder();
        let ints = [rows as i32, d as i32, bits as i32, tables as i32, per as i32];
        b.arg(&xs).arg(&ws).arg(&codes);
        for i in &ints {
            b.arg(i);
        }
        // SAFETY: sizes from the checked shapes; the shared rows fit (d ≤ MAX_D).
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(codes, dev), Shape::from((rows, tables))))
    }
}

pub fn simhash_codes(x: &Tensor, w: &Tensor, dims: (usize, usize, usize, usize)) -> Result<Tensor> {
    if dims.1 > MAX_D {
        candle_core::bail!("simhash_codes: head dim {} > {MAX_D}", dims.1);
    }
    let (x, w) = (x.to_dtype(DType::F32)?.contiguous()?, w.to_dtype(DType::F32)?.contiguous()?);
    x.apply_op2_no_bwd(&w, &CudaOnly(SimHash { dims }))
}

/// One thread per (query head, token) or one warp per (query head, block): the launch size.
fn grid_for(threads: usize, what: &str) -> Result<LaunchConfig> {
    let Ok(total) = u32::try_from(threads) else {
        candle_core::bail!("{what}: {threads} threads are more than one launch holds");
    };
    Ok(LaunchConfig {
        grid_dim: (total.div_ceil(HASH_THREADS).max(1), 1, 1),
        block_dim: (HASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

struct LabelScores {
    dims: (usize, usize, usize, usize),
    bits: usize,
}

impl CudaOp3 for LabelScores {
    const NAME: &'static str = "folio-label-scores";

    fn cuda_fwd(
        &self,
        [(ql, qll), (codes, cl), (scale, sl)]: [(&CudaStorage, &Layout); 3],
    ) -> Result<(CudaStorage, Shape)> {
        let (heads, kv_heads, n, r) = self.dims;
        let dev = ql.device().clone();
        let qs = ql.as_cuda_slice::<f32>()?.slice(qll.start_offset()..);
        let cs = codes.as_cuda_slice::<u8>()?.slice(cl.start_offset()..);
        let ss = scale.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        // SAFETY: one thread writes each score.
        let out = unsafe { dev.alloc::<f32>(heads * n)? };
        let cfg = grid_for(heads * n, "label_scores")?;
        let func = dev.get_or_load_custom_func("label_scores", MODULE, PTX)?;
        let mut b = func.builder();
        let ints = [heads as i32, kv_heads as i32, n as i32, r as i32];
        let max_q = ((1u32 << self.bits) - 1) as f32;
        b.arg(&qs).arg(&cs).arg(&ss).arg(&out);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&max_q);
        // SAFETY: sizes from the checked shapes.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((heads, n))))
    }
}

pub fn label_scores(
    ql: &Tensor,
    codes: &Tensor,
    scale: &Tensor,
    dims: (usize, usize, usize, usize),
    bits: usize,
) -> Result<Tensor> {
    let ql = ql.to_dtype(DType::F32)?.contiguous()?;
    let scale = scale.to_dtype(DType::F32)?.contiguous()?;
    // The kernel reads codes 16 at a time: a view starting mid-vector is copied first.
    let codes = if codes.layout().start_offset().is_multiple_of(16) { codes.contiguous()? } else { codes.copy()? };
    ql.apply_op3_no_bwd(&codes, &scale, &CudaOnly(LabelScores { dims, bits }))
}
