//! The sparse prefill as a prefill mode: a context made with it records it, holds exactly the
//! K/V the in-memory layer-major prefill of the same mode computes, and differs from a dense
//! one where the mode is sparse; on a GPU its fast path (the tensor-core kernel over gathered
//! rows, bf16) against the CPU reference from the definition.

use candle_core::Tensor;
use folio_models::attention::SparsePrefill;
use folio_models::context::{self, BuildOptions, ContextFile, KvDtype};
use folio_models::prefill::{prefill_layers, PrefillMode};
use folio_models::Result;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::ops::ControlFlow;

#[path = "../../kernels/tests/common/mod.rs"]
mod common;

mod support;
use support::{engine, plan, smallest_budget_for};

/// A context prefilled sparsely in several chunks, which the plan ends on whole query blocks
/// (blocks cut by a chunk's edge are the unit tests'): the file records the mode, its K/V is
/// exactly the in-memory sparse prefill's, layer 0's is dense's (nothing attends before it) and
/// the last layer's is not.
#[test]
fn a_sparse_prefill_is_recorded_and_matches_the_in_memory_one() -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let e = engine("llama");
    let n = 300;
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..e.config().vocab_size as u32)).collect();
    let mode = PrefillMode::Sparse(SparsePrefill::new(6, 12, 6, 12)?);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sparse.folio");
    let opts = BuildOptions {
        memory_budget: Some(smallest_budget_for(&e, n, KvDtype::F32, mode)),
        prefill: mode,
        ..BuildOptions::new(KvDtype::F32)
    };
    let report =
        context::build(&e.model, e.stamp()?, &plan(tokens.clone()), &out, &opts, &mut |_| ControlFlow::Continue(()))?;
    assert!(report.chunk < n / 3 && report.chunk % 6 == 0, "chunk {}: several, of whole blocks", report.chunk);
    assert_eq!(report.prefill, "sparse:block=6,keys=12,sinks=6,window=12");
    let file = ContextFile::open(&out)?;
    let runs = file.header().prefill_runs();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].from, runs[0].to, runs[0].mode.as_str()), (0, n, report.prefill.as_str()));

    let layers = e.config().num_layers;
    let mut sparse = Vec::new();
    prefill_layers(&e.model, &tokens, (report.chunk, mode), |_, k, v| {
        sparse.push((k, v));
        Ok(())
    })?;
    let mut dense = Vec::new();
    prefill_layers(&e.model, &tokens, (report.chunk, PrefillMode::Dense), |_, k, _| {
        dense.push(k);
        Ok(())
    })?;
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (layer, (k, v)) in sparse.iter().enumerate() {
        let (fk, fv) = file.layer_kv(layer)?;
        assert_eq!((flat(k), flat(v)), (fk, fv), "layer {layer}: the file's K/V is the in-memory sparse prefill's");
    }
    let diff = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(diff(&sparse[0].0, &dense[0]), 0.0, "layer 0's keys come before any attention");
    let last = diff(&sparse[layers - 1].0, &dense[layers - 1]);
    println!("last layer's keys, sparse vs dense prefill: max |diff| {last:.3e}");
    assert!(last > 1e-4, "seed {seed}: a sparse prefill of 300 tokens in blocks of 6 changed nothing");
    Ok(())
}

/// On a GPU, bf16 as a prefill runs: the fast path's chunks (tensor-core attention over rows
/// gathered on the device, the estimate's top-k on it) against the reference from the definition
/// on the same bf16 values, at the default pattern and a 7B model's head shape (GQA 7).
#[cfg(feature = "cuda")]
#[test]
fn the_fast_path_on_cuda_matches_the_reference() -> Result<()> {
    use candle_core::{DType, Device};
    use folio_models::attention::{LayerRows, SparseAttention};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let gpu = Device::new_cuda(0)?;
    let (heads, kv_heads, d, n) = (14, 2, 128, 6144);
    let pattern = SparsePrefill::DEFAULT;
    let draw =
        |rng: &mut StdRng, len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let on_gpu = |x: Vec<f32>, shape: (usize, usize, usize)| -> Result<Tensor> {
        Ok(Tensor::from_vec(x, shape, &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(&gpu)?)
    };
    let (k, v) = (
        on_gpu(draw(&mut rng, kv_heads * n * d), (kv_heads, n, d))?,
        on_gpu(draw(&mut rng, kv_heads * n * d), (kv_heads, n, d))?,
    );
    let q = on_gpu(draw(&mut rng, heads * n * d), (heads, n, d))?;
    let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
    let attn = SparseAttention::new(pattern);
    let scale = 1.0 / (d as f32).sqrt();
    for (from, to) in [(0, 2048), (2048, 4100), (4100, n)] {
        let qc = q.narrow(1, from, to - from)?;
        let (kc, vc) = (k.narrow(1, 0, to)?, v.narrow(1, 0, to)?);
        let got = attn.attend_chunk(&qc, &kc, &vc, from, scale)?;
        let rows =
            LayerRows { k: host(&kc.contiguous()?)?, v: host(&vc.contiguous()?)?, kv_heads, len: to, head_dim: d };
        let (want, want_lse) = pattern.reference(&host(&qc.contiguous()?)?, &rows, (heads, to - from), from, scale);
        let (out, lse) = (host(&got.out)?, host(&got.lse)?);
        let e_out = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        let e_lse = lse.iter().zip(&want_lse).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        println!("rows {from}..{to} on CUDA: max |fast - reference| out {e_out:.2e}, lse {e_lse:.2e}");
        assert!(e_out < 2e-2 && e_lse < 1e-2, "seed {seed}: rows {from}..{to}: out {e_out}, lse {e_lse}");
    }
    Ok(())
}
