//! The planner's weight bytes against what a built model holds: `plan::weight_bytes` is what
//! `folio bench --shape` refuses a run by before it allocates, so it must agree with the census of
//! the model the run then builds — per fixture (tied and untied heads), per quantisation (one that
//! quantizes a 64-wide model, one that cannot), and on the GPU, where the embedding table lives in
//! host memory unless the head multiplies by it.

use candle_core::{DType, Device};
use folio_models::config::ModelConfig;
use folio_models::model::{embedding_on_host, Model, Quantize};
use folio_models::plan::weight_bytes;

mod support;
use support::model_dir;

const FIXTURES: [&str; 5] = ["llama", "qwen2", "qwen3", "mistral", "demo"];
const INIT_STD: f64 = 0.02;

/// Each fixture's planned device bytes equal the built model's, and the host's share is the
/// embedding table exactly when `embedding_on_host` says so.
fn planned_bytes_match_the_model(device: &Device, dtype: DType) {
    for name in FIXTURES {
        let cfg = ModelConfig::from_file(&model_dir(name).join("config.json")).unwrap();
        for quantize in [None, Some(Quantize::Q8_0), Some(Quantize::Q4K)] {
            let model = Model::random(&cfg, device, dtype, INIT_STD, quantize).unwrap();
            let census = model.weights();
            let planned = weight_bytes(&cfg, dtype, quantize, device);
            assert_eq!(planned, census.device_bytes(), "{name} {quantize:?} on {device:?}: planned device bytes");
            let table = (cfg.vocab_size * cfg.hidden_size * dtype.size_in_bytes()) as u64;
            let head_quantized = quantize.is_some_and(|q| cfg.hidden_size.is_multiple_of(q.dtype().block_size()));
            let on_host = embedding_on_host(device, dtype, cfg.hidden_size, cfg.tie_word_embeddings && !head_quantized);
            assert_eq!(census.host_bytes, if on_host { table } else { 0 }, "{name} {quantize:?}: bytes in host memory");
        }
    }
}

#[test]
fn planned_weight_bytes_match_the_model_on_the_cpu() {
    planned_bytes_match_the_model(&Device::Cpu, DType::F32);
    // No weights live in host memory beside a CPU model.
    let cfg = ModelConfig::from_file(&model_dir("demo").join("config.json")).unwrap();
    let model = Model::random(&cfg, &Device::Cpu, DType::F32, INIT_STD, None).unwrap();
    assert_eq!(model.weights().host_bytes, 0);
}

/// On the GPU the table of an untied model is in host memory and the GPU gathers its rows: they
/// equal the rows of the same table kept on the device, for fresh random ids (tests/parity.rs's
/// `cuda_logits_match_cpu` holds whole forward passes over such tables to the CPU's).
#[cfg(feature = "cuda")]
#[test]
fn planned_weight_bytes_match_the_model_and_host_rows_the_table_on_the_gpu() {
    use folio_models::model::Embedding;
    use rand::{Rng, SeedableRng};
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    planned_bytes_match_the_model(&gpu, DType::BF16);
    planned_bytes_match_the_model(&gpu, DType::F32);
    let cfg = ModelConfig::from_file(&model_dir("demo").join("config.json")).unwrap();
    let model = Model::random(&cfg, &gpu, DType::BF16, INIT_STD, None).unwrap();
    let table = (cfg.vocab_size * cfg.hidden_size * 2) as u64;
    assert_eq!(model.weights().host_bytes, table, "the demo model's untied table is in host memory");
    let seed = rand::random::<u64>();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for dtype in [DType::BF16, DType::F32] {
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let table = candle_core::Tensor::randn(0f32, 1.0, (vocab, hidden), &gpu).unwrap().to_dtype(dtype).unwrap();
        let host = Embedding::place(table.clone(), &gpu, false).unwrap();
        let here = Embedding::place(table, &gpu, true).unwrap();
        assert!(host.on_host() && !here.on_host());
        for t in [1, 7, 300] {
            // The table's first and last rows, and random ones.
            let mut ids: Vec<u32> = (0..t).map(|_| rng.random_range(0..vocab as u32)).collect();
            ids[0] = 0;
            ids[t - 1] = vocab as u32 - 1;
            let (a, b) = (host.rows(&ids, &gpu).unwrap(), here.rows(&ids, &gpu).unwrap());
            assert_eq!(a.dims(), [t, hidden]);
            assert_eq!(a.device().location(), gpu.location());
            let diff = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "{dtype:?}, {t} ids (seed {seed}): rows gathered from host memory differ");
        }
    }
}
