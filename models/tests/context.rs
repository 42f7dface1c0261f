//! Context files at the library level: a saved and reopened context gives exactly the logits
//! of the never-saved path (CPU f32), the layer-major prefill agrees with the token-major
//! forward, and bf16, bf16-fp8 and fp8 storage errors are measured against f32.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use folio_models::attention::{Attended, Attention, AttnCall, Dense, Knobs};
use folio_models::context::{self, ContextFile, KvDtype};
use folio_models::kv_cache::OffloadKv;
use folio_models::kv_cache::{ContextKv, KvStore, Reference};
use folio_models::model::Logits;
use folio_models::prefill::prefill_in_memory;
use folio_models::{Engine, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};

// The kernels' shared test helpers (a replayable seed).
#[path = "../../kernels/tests/common/mod.rs"]
mod common;

mod support;
use support::{build, engine, model_dir, plan, sample_documents, smallest_budget};

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Logits of `question` appended to a context whose prefix store is `kv`.
fn ask(e: &Engine, kv: &mut ContextKv, question: &[u32]) -> Result<Tensor> {
    e.model.forward(question, kv, &Dense, Logits::All)
}

/// Saved + reopened == never saved, bit for bit, on every architecture flag that touches K/V
/// (GQA + llama3 RoPE, q/k norm with its own head_dim, a sliding window shorter than the prompt).
#[test]
fn reopened_context_gives_the_never_saved_logits_exactly() -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for name in ["llama", "qwen3", "mistral"] {
        let e = engine(name);
        let vocab = e.config().vocab_size as u32;
        let n = rng.random_range(60..200);
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
        let question: Vec<u32> = (0..rng.random_range(1..20)).map(|_| rng.random_range(0..vocab)).collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c.folio");
        let budget = smallest_budget(&e, n, KvDtype::F32);
        let report = build(&e, &plan(tokens.clone()), &out, KvDtype::F32, Some(budget));
        assert!(report.chunk < n / 3, "{name}: the budget should force several chunks, got {}", report.chunk);
        assert!(!context::partial_dir(&out).exists(), "the partial folder is gone after success");

        let (layers, last) = prefill_in_memory(&e.model, &tokens, report.chunk)?;
        let mut never_saved = ContextKv::from_layers(layers, DType::F32, &Device::Cpu)?;
        let file = Arc::new(e.open_context(&out)?);
        assert_eq!(file.tokens(), tokens.as_slice());
        let mut reopened = ContextKv::new(file, DType::F32, &Device::Cpu, u64::MAX);
        let a = ask(&e, &mut never_saved, &question)?;
        let b = ask(&e, &mut reopened, &question)?;
        assert_eq!(max_diff(&a, &b), 0.0, "{name} (seed {seed}): reopened logits differ");
        assert_eq!(report.next_token, last.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?);

        // Against the token-major forward over prefix + question: same math, other order.
        let mut plain = e.model.new_kv();
        let full: Vec<u32> = tokens.iter().chain(&question).copied().collect();
        let all = e.model.forward(&full, &mut plain, &Dense, Logits::All)?;
        let c = all.narrow(0, n, question.len())?;
        let d = max_diff(&a, &c);
        println!("{name}: n {n}, chunk {}, layer-major vs token-major max |logit diff| {d:.2e}", report.chunk);
        assert!(d < 1e-4, "{name} (seed {seed}): layer-major prefill differs from token-major by {d}");
        assert!(max_diff(&last, &all.narrow(0, n - 1, 1)?) < 1e-4, "{name}: prefill's last logits");
    }
    Ok(())
}

/// Largest logit error, as a share of the logit range, over the question's positions: bf16 keeps
/// 8 mantissa bits of every K/V element; fp8 e4m3 keeps 3 (a 2^-4 step), and the demo model's
/// sharp copying heads turn that into a larger swing where the next word is a near tie (run 1:
/// 2.8%; the fine-tuned model: 13.7%, at the word after the key, docs/context-file.md).
const BF16_TOLERANCE: f32 = 0.01;
const FP8_TOLERANCE: f32 = 0.2;
/// bf16 keys with fp8 values: the values' rounding is averaged by the attention (0.83% measured
/// when it was introduced, 2026-11-22), so it stays near bf16.
const BF16_FP8_TOLERANCE: f32 = 0.02;
/// Where the value starts, every lossy dtype must stay within this and pick the same digit.
const ANSWER_TOLERANCE: f32 = 0.05;

/// bf16, bf16-fp8 and fp8 storage against f32 on the demo model's real K/V: logit error as a share of
/// the logit range (docs/context-file.md records the figures).
#[test]
fn lossy_kv_dtypes_stay_within_tolerance() -> Result<()> {
    let e = engine("demo");
    let text = std::fs::read_to_string(model_dir("demo").join("../../samples/field_notes.txt")).unwrap();
    let tokens = e.tokenizer.encode_raw(&text.repeat(3))?;
    let question = e.tokenizer.encode_text("the secret code of amber falcon is")?;
    let dir = tempfile::tempdir().unwrap();
    let mut logits = Vec::new();
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Bf16Fp8, KvDtype::Fp8] {
        let out = dir.path().join(format!("{}.folio", dtype.name()));
        let r = build(&e, &plan(tokens.clone()), &out, dtype, None);
        let file = Arc::new(e.open_context(&out)?);
        let mut kv = ContextKv::new(file, DType::F32, &Device::Cpu, u64::MAX);
        logits.push((dtype, r.file_bytes, ask(&e, &mut kv, &question)?));
        assert_eq!(kv.len(), tokens.len() + question.len());
    }
    let (_, f32_bytes, exact) = &logits[0];
    let range = exact.max_all()?.to_scalar::<f32>()? - exact.min_all()?.to_scalar::<f32>()?;
    let last = question.len() - 1;
    for (dtype, bytes, l) in &logits[1..] {
        let rel = max_diff(exact, l) / range;
        let rel_answer = max_diff(&exact.get(last)?, &l.get(last)?) / range;
        let argmax_same = exact.argmax(1)?.to_vec1::<u32>()? == l.argmax(1)?.to_vec1::<u32>()?;
        let answer_same =
            exact.get(last)?.argmax(0)?.to_scalar::<u32>()? == l.get(last)?.argmax(0)?.to_scalar::<u32>()?;
        println!(
            "{}: {} tokens, file {bytes} B ({:.2}x f32), max |logit diff| / range {rel:.4} ({rel_answer:.4} where the \
             value starts), greedy tokens equal: {argmax_same}",
            dtype.name(),
            tokens.len(),
            *bytes as f64 / *f32_bytes as f64
        );
        // What a reader gets: the value's first digit, predicted after "... is", as from f32.
        assert!(answer_same && rel_answer < ANSWER_TOLERANCE, "{}: answer logit error {rel_answer}", dtype.name());
        let tolerance = match dtype {
            KvDtype::Bf16 => BF16_TOLERANCE,
            KvDtype::Bf16Fp8 => BF16_FP8_TOLERANCE,
            _ => FP8_TOLERANCE,
        };
        assert!(rel < tolerance, "{}: logit error {rel} of the range", dtype.name());
    }
    Ok(())
}

/// Writing inside the saved prefix is refused; the store only grows past it.
#[test]
fn saved_prefix_is_read_only() -> Result<()> {
    let e = engine("llama");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.folio");
    build(&e, &plan((0..50).collect()), &out, KvDtype::Bf16, None);
    let mut kv = ContextKv::new(Arc::new(e.open_context(&out)?), DType::F32, &Device::Cpu, 0);
    let cfg = e.config();
    let row = Tensor::zeros((cfg.num_kv_heads, 1, cfg.head_dim), DType::F32, &Device::Cpu)?;
    let err = kv.write(0, 10, &row, &row).unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
    // A zero resident budget still works: each layer is decoded on use and dropped.
    e.model.forward(&[1, 2, 3], &mut kv, &Dense, Logits::Last)?;
    assert_eq!(kv.len(), 53);
    assert!(kv.resident_bytes() <= (2 * cfg.num_kv_heads * 50 * cfg.head_dim * 4) as u64);
    Ok(())
}

/// The layer-major prefill on CUDA against the CPU's (f32): same logits to 1e-4; and a file
/// prefilled on the GPU opens and answers on the CPU (context files are device-independent).
#[cfg(feature = "cuda")]
#[test]
fn cuda_prefill_matches_cpu() -> Result<()> {
    let cpu = engine("llama");
    let gpu = Engine::load(model_dir("llama").to_str().unwrap(), &Device::new_cuda(0)?, DType::F32)?;
    let mut rng = StdRng::seed_from_u64(7);
    let tokens: Vec<u32> = (0..300).map(|_| rng.random_range(0..cpu.config().vocab_size as u32)).collect();
    let question = [5, 9, 13];
    let (cpu_layers, cpu_last) = prefill_in_memory(&cpu.model, &tokens, 32)?;
    let (gpu_layers, gpu_last) = prefill_in_memory(&gpu.model, &tokens, 32)?;
    let d_last = max_diff(&cpu_last, &gpu_last.to_device(&Device::Cpu)?);
    let mut a = ContextKv::from_layers(cpu_layers, DType::F32, &Device::Cpu)?;
    let mut b = ContextKv::from_layers(gpu_layers, DType::F32, gpu.model.device())?;
    let (la, lb) = (ask(&cpu, &mut a, &question)?, ask(&gpu, &mut b, &question)?.to_device(&Device::Cpu)?);
    let d_ask = max_diff(&la, &lb);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu.folio");
    build(&gpu, &plan(tokens.clone()), &out, KvDtype::F32, None);
    let mut reopened = ContextKv::new(Arc::new(cpu.open_context(&out)?), DType::F32, &Device::Cpu, u64::MAX);
    let d_file = max_diff(&la, &ask(&cpu, &mut reopened, &question)?);
    println!("cuda vs cpu: prefill last logits {d_last:.2e}, question {d_ask:.2e}, GPU-made file on CPU {d_file:.2e}");
    assert!(d_last < 1e-4 && d_ask < 1e-4 && d_file < 1e-4);
    Ok(())
}

/// A layer's K/V encoded on the GPU (fp8 by the device kernel, bf16 and f32 as their own
/// bytes) is byte for byte what the CPU codec makes of the same values.
#[cfg(feature = "cuda")]
#[test]
fn encode_on_the_device_is_the_cpu_encode() -> Result<()> {
    use folio_models::context::format::SectionKind;
    use folio_models::context::EncodeTensor;
    let gpu = Device::new_cuda(0)?;
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (heads, rows, d) = (4, 3000, 128);
    let x: Vec<f32> = (0..heads * rows * d).map(|i| rng.random_range(-1.0..1.0) * [1.0, 40.0, 1e-3][i % 3]).collect();
    for dtype in [DType::BF16, DType::F32, DType::F16] {
        let t = Tensor::from_vec(x.clone(), (heads, rows, d), &gpu)?.to_dtype(dtype)?;
        let held = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for kv in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8] {
            let codec = kv.codec(SectionKind::Values);
            let (on_gpu, on_cpu) = (codec.encode_tensor(&t, d)?, codec.encode(&held, d)?);
            assert!(on_gpu == on_cpu, "seed {seed}: {dtype:?} values in a {} section", kv.name());
        }
    }
    Ok(())
}

/// Indexes stored as context-file sections load back to the index that was built: decoding
/// with the stored one gives the built one's logits bit for bit, for every method that keeps
/// an index, and each run reports where its index came from.
#[test]
fn stored_indexes_decode_exactly_as_built_ones() -> Result<()> {
    use folio_models::attention::{by_name, parse_params, Channels, IndexSource, Resources};
    let e = engine("llama");
    let cfg = e.config().clone();
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let (plain, indexed) = (dir.path().join("plain.folio"), dir.path().join("indexed.folio"));
    build(&e, &plan((0..400).map(|_| rng.random_range(5..500)).collect()), &plain, KvDtype::F32, None);
    let stat: Vec<Vec<Vec<f64>>> = (0..cfg.num_layers)
        .map(|_| (0..cfg.num_kv_heads).map(|_| (0..cfg.head_dim).map(|_| rng.random()).collect()).collect())
        .collect();
    let resources = Resources { channels: Some(Arc::new(Channels::from_statistic(&stat))) };
    let question: Vec<u32> = (0..6).map(|_| rng.random_range(5..500)).collect();
    for (name, params) in [
        ("magicpig", vec!["dense_layers=0", "window=8"]),
        ("double-sparsity", vec![]),
        ("topk-ivf", vec!["nlist=8", "nprobe=2", "window=8"]),
    ] {
        let params = parse_params(&params.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
        let method = by_name(name, Some("10%"), &params, &resources)?;
        let file = Arc::new(e.open_context(&plain)?);
        let kv = ContextKv::new(file.clone(), DType::F32, &Device::Cpu, 1 << 30);
        let sections: Vec<(String, usize, Vec<u8>)> = (0..cfg.num_layers)
            .filter_map(|l| method.index_section(&kv, l, cfg.num_layers).transpose())
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .enumerate()
            .map(|(l, (n, b))| (n, l, b))
            .collect();
        assert_eq!(sections.len(), cfg.num_layers, "{name}: one section per layer");
        file.write_with_indexes(&indexed, sections)?;
        let reopened = Arc::new(e.open_context(&indexed)?);
        reopened.verify()?;
        let decode = |file: Arc<context::ContextFile>, expect: IndexSource| -> Result<Vec<Tensor>> {
            method.reset();
            let mut kv = ContextKv::new(file, DType::F32, &Device::Cpu, 1 << 30);
            let mut out = vec![e.model.forward(&question, &mut kv, method.as_ref(), Logits::Last)?];
            for t in [7u32, 9, 11] {
                out.push(e.model.forward(&[t], &mut kv, method.as_ref(), Logits::Last)?);
            }
            let sources = method.index_sources();
            assert!(sources.len() == cfg.num_layers && sources.values().all(|s| *s == expect), "{name}: {sources:?}");
            Ok(out)
        };
        let built = decode(file, IndexSource::Built)?;
        let loaded = decode(reopened, IndexSource::File)?;
        for (a, b) in built.iter().zip(&loaded) {
            assert_eq!(max_diff(a, b), 0.0, "seed {seed}: {name}: stored index decodes differently");
        }
    }
    Ok(())
}

/// A method that keeps what each of its calls read: per call, per query head, the sorted rows
/// (`None`: every visible row).
struct Recorded {
    method: Box<dyn Attention>,
    reads: Mutex<Vec<Option<Vec<Vec<usize>>>>>,
}

impl Recorded {
    fn new(method: Box<dyn Attention>) -> Self {
        Self { method, reads: Mutex::new(Vec::new()) }
    }

    fn take(&self) -> Vec<Option<Vec<Vec<usize>>>> {
        std::mem::take(&mut *self.reads.lock().unwrap())
    }
}

impl Attention for Recorded {
    fn knobs(&self) -> Knobs<'_> {
        self.method.knobs()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let got = self.method.attend(call)?;
        let rows = got.read.rows()?.map(|r| r.into_owned());
        self.reads.lock().unwrap().push(rows);
        Ok(got)
    }

    fn reset(&self) {
        self.method.reset();
    }
}

/// Of the rows `want` read over a step's calls, the share `got` read too (1 when both read all).
fn read_overlap(want: &[Option<Vec<Vec<usize>>>], got: &[Option<Vec<Vec<usize>>>]) -> f64 {
    assert_eq!(want.len(), got.len(), "the two paths made different numbers of attention calls");
    let (mut shared, mut total) = (0usize, 0usize);
    for (w, g) in want.iter().zip(got) {
        match (w, g) {
            (None, None) => {}
            (Some(w), Some(g)) => {
                for (w, g) in w.iter().zip(g) {
                    total += w.len();
                    shared += w.iter().filter(|p| g.binary_search(p).is_ok()).count();
                }
            }
            _ => return 0.0,
        }
    }
    if total == 0 {
        1.0
    } else {
        shared as f64 / total as f64
    }
}

/// Decoding over a saved context through each tier's fast paths — offloaded (rows in host
/// memory, read by what each method picks), the file tier (rows left in the file, read through
/// a cache a few blocks large: most reads miss, some pass it by) and resident (rows on the
/// device); on a GPU, the kernels — gives the CPU references' logits at every step of their greedy answer,
/// teacher-forced, for each method with a fast path.
///
/// A method that ranks keys by a score the fast path sums in another order (or, for
/// MagicPIG's SimHash codes, from a query computed on another device) may swap a key tied to
/// rounding at the k-th place: one key of dozens, a logit shift no rounding bound covers (a
/// key of the demo model's random weights can move a logit by 1e-2). So the check follows the
/// reads: while both paths read the same rows at every call, the logits agree to rounding and
/// the greedy tokens agree wherever the reference's top two are apart by more than that; once
/// a step reads other rows, each later step must still read nearly the reference's rows.
fn offloaded_decode_matches_resident(device: &Device) -> Result<()> {
    use folio_models::attention::{by_name, Channels, Resources};
    use folio_models::kv_cache::OffloadKv;
    /// Logit agreement while both paths read the same rows: f32 rounding of sums in another order.
    const SAME_READS_TOL: f32 = 1e-3;
    /// After a swap at a tie, the least share of the reference's rows a step must still read.
    const MIN_OVERLAP: f64 = 0.95;
    let cpu = engine("demo");
    let fast = Engine::load(model_dir("demo").to_str().unwrap(), device, DType::F32)?;
    let cfg = cpu.config().clone();
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ctx.folio");
    let vocab = cfg.vocab_size as u32;
    build(&cpu, &plan((0..900).map(|_| rng.random_range(5..vocab)).collect()), &out, KvDtype::F32, None);
    let file = Arc::new(cpu.open_context(&out)?);
    let question: Vec<u32> = (0..6).map(|_| rng.random_range(5..vocab)).collect();
    let stat: Vec<Vec<Vec<f64>>> = (0..cfg.num_layers)
        .map(|_| (0..cfg.num_kv_heads).map(|_| (0..cfg.head_dim).map(|_| rng.random()).collect()).collect())
        .collect();
    let resources = Resources { channels: Some(Arc::new(Channels::from_statistic(&stat))) };
    const STEPS: usize = 10;
    for (name, budget) in [
        ("dense", None),
        ("streaming", Some("10%")),
        ("topk", Some("5%")),
        ("double-sparsity", Some("10%")),
        ("buzz", Some("30%")),
        ("hip", Some("10%")),
        ("magicpig", Some("10%")),
    ] {
        let offloaded: Box<dyn KvStore> = Box::new(OffloadKv::from_context(file.clone(), DType::F32, device)?);
        let resident: Box<dyn KvStore> = Box::new(ContextKv::new(file.clone(), DType::F32, device, u64::MAX));
        let on_file: Box<dyn KvStore> = Box::new(OffloadKv::on_file(file.clone(), 6 << 16, DType::F32, device)?);
        for (tier, mut got_kv) in [("offloaded", offloaded), ("file", on_file), ("resident", resident)] {
            let reference = Recorded::new(by_name(name, budget, &[], &resources)?);
            let method = Recorded::new(by_name(name, budget, &[], &resources)?);
            let mut want_kv = Reference(ContextKv::new(file.clone(), DType::F32, &Device::Cpu, u64::MAX));
            let (mut ids, mut worst, mut flips) = (question.clone(), 0f32, 0);
            let (mut swapped_at, mut least_overlap) = (None, 1f64);
            for step in 0..STEPS {
                let want = cpu.model.forward(&ids, &mut want_kv, &reference, Logits::Last)?;
                let got = fast.model.forward(&ids, got_kv.as_mut(), &method, Logits::Last)?.to_device(&Device::Cpu)?;
                let overlap = read_overlap(&reference.take(), &method.take());
                least_overlap = least_overlap.min(overlap);
                if overlap < 1.0 && swapped_at.is_none() {
                    swapped_at = Some(step);
                }
                if swapped_at.is_some() {
                    assert!(
                        overlap >= MIN_OVERLAP,
                        "seed {seed}: {name} on the {tier} tier read {:.1}% of the reference's rows at step {step}",
                        overlap * 100.0
                    );
                    ids = vec![argmax(&want.flatten_all()?.to_vec1()?) as u32];
                    continue;
                }
                worst = worst.max(max_diff(&want, &got));
                let (w, g): (Vec<f32>, Vec<f32>) = (want.flatten_all()?.to_vec1()?, got.flatten_all()?.to_vec1()?);
                let top = argmax(&w);
                let margin =
                    w[top] - w.iter().enumerate().filter(|(i, _)| *i != top).map(|x| *x.1).fold(f32::MIN, f32::max);
                if argmax(&g) != top {
                    assert!(
                        margin < SAME_READS_TOL,
                        "seed {seed}: {name} picks another token over a margin of {margin}"
                    );
                    flips += 1;
                }
                ids = vec![top as u32];
            }
            let same = swapped_at.unwrap_or(STEPS);
            println!(
                "{device:?} {name}, {tier}: same reads for {same} of {STEPS} steps, max |logit - CPU reference| over them = {worst:.2e}, {flips} near-tie flips; least read overlap {:.3} (seed {seed})",
                least_overlap
            );
            assert!(
                worst < SAME_READS_TOL,
                "seed {seed}: {name} on the {tier} tier: logits differ by {worst} over the same reads"
            );
            if matches!(name, "dense" | "streaming") {
                assert_eq!(swapped_at, None, "seed {seed}: {name} reads by position, never by a score");
            }
        }
    }
    Ok(())
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap()
}

#[test]
fn offloaded_decode_matches_resident_cpu() -> Result<()> {
    offloaded_decode_matches_resident(&Device::Cpu)
}

#[cfg(feature = "cuda")]
#[test]
fn offloaded_decode_matches_resident_cuda() -> Result<()> {
    offloaded_decode_matches_resident(&Device::new_cuda(0)?)
}

/// The offloaded tier reads a file's K/V in place, in the file's dtype, and widens what it
/// gathers: every row it gives equals the resident tier's decode of the same section, bit for
/// bit, for every storage dtype and the dtypes a model computes in on `device`; a damaged
/// section is refused at open, naming it.
fn offloaded_tier_reads_each_kv_dtype_in_place(device: &Device) -> Result<()> {
    let e = engine("demo");
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..300).map(|_| rng.random_range(5..e.config().vocab_size as u32)).collect();
    let computes: &[DType] = if device.is_cuda() { &[DType::BF16, DType::F32] } else { &[DType::F32] };
    for kv_dtype in [KvDtype::Bf16, KvDtype::Bf16Fp8, KvDtype::Fp8, KvDtype::F32] {
        let out = dir.path().join(format!("{}.folio", kv_dtype.name()));
        build(&e, &plan(tokens.clone()), &out, kv_dtype, None);
        let file = Arc::new(e.open_context(&out)?);
        for &dtype in computes {
            let offloaded = OffloadKv::from_context(file.clone(), dtype, device)?;
            assert!(offloaded.in_place());
            // A second store over the same file while the first lives shares its registration;
            // the copy path (for GPUs that cannot register it) holds the same rows.
            let again = OffloadKv::from_context(file.clone(), dtype, device)?;
            let copied = OffloadKv::copied(file.clone(), dtype, device)?;
            let resident = ContextKv::new(file.clone(), dtype, device, u64::MAX);
            for layer in 0..e.config().num_layers {
                let rows = |kv: &dyn KvStore| -> Result<(Vec<f32>, Vec<f32>)> {
                    let segs = kv.segments(layer, tokens.len())?;
                    let flat =
                        |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?) };
                    assert_eq!(segs[0].k.dtype(), dtype);
                    Ok((flat(&segs[0].k)?, flat(&segs[0].v)?))
                };
                let want = rows(&resident)?;
                for (path, kv) in [("in place", &offloaded), ("in place again", &again), ("copied", &copied)] {
                    assert!(
                        rows(kv)? == want,
                        "seed {seed}: {} rows read {path} as {dtype:?} on {device:?}, layer {layer}",
                        kv_dtype.name()
                    );
                }
            }
        }
        println!("{device:?}: {} file read in place as {computes:?}: every row equal", kv_dtype.name());
    }
    // One byte of the last layer's values flipped: refused at open, the section named.
    let path = dir.path().join("fp8.folio");
    let (at, bytes) = *ContextFile::open(&path)?.kv_sections()?.last().unwrap();
    let mut raw = std::fs::read(&path).unwrap();
    raw[at + bytes / 2] ^= 0x40;
    let damaged = dir.path().join("damaged.folio");
    std::fs::write(&damaged, raw).unwrap();
    let err = OffloadKv::from_context(Arc::new(ContextFile::open(&damaged)?), DType::F32, device).err().unwrap();
    assert!(err.to_string().contains("corrupted"), "{err}");
    Ok(())
}

#[test]
fn offloaded_tier_reads_each_kv_dtype_in_place_cpu() -> Result<()> {
    offloaded_tier_reads_each_kv_dtype_in_place(&Device::Cpu)
}

#[cfg(feature = "cuda")]
#[test]
fn offloaded_tier_reads_each_kv_dtype_in_place_cuda() -> Result<()> {
    offloaded_tier_reads_each_kv_dtype_in_place(&Device::new_cuda(0)?)
}

/// assets/samples' three documents, as ingestion reads them.
/// A source's excerpts from the samples context: random passages inside a document come back
/// as read pieces whose text is the passage's tokens decoded, inside windows whose whole text
/// is the window's tokens decoded, in document order; no passage gives the opening; a passage
/// outside the document is refused.
#[test]
fn excerpts_show_the_passages_read_in_their_text() -> Result<()> {
    use folio_models::attention::reads::Passage;
    use folio_models::excerpt::{excerpts, AROUND, OPENING};
    let e = engine("demo");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("samples.folio");
    build(&e, &e.plan_context(&sample_documents(), None, None)?, &out, KvDtype::F32, None);
    let file = context::ContextFile::open(&out)?;
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let doc = rng.random_range(0..file.documents().len());
    let (ds, de) = (file.documents()[doc].start, file.documents()[doc].end);
    let mut passages: Vec<Passage> = (0..3)
        .map(|_| {
            let start = rng.random_range(ds..de - 8);
            Passage {
                start,
                end: (start + rng.random_range(1..32)).min(de),
                share: rng.random_range(0.0..1.0),
                part: None,
            }
        })
        .collect();
    passages.sort_by_key(|p| p.start);
    passages.dedup_by(|b, a| b.start < a.end);
    let got = excerpts(&e.tokenizer, &file, doc, &passages, AROUND)?;
    assert_eq!((got.document, got.tokens, &got.title), (doc, de - ds, &file.documents()[doc].title));
    let decode = |a: usize, b: usize| e.tokenizer.decode(&file.tokens()[a..b], true).unwrap();
    let mut read = Vec::new();
    for x in &got.excerpts {
        let whole: String = x.pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(whole, decode(ds + x.start, ds + x.end), "seed {seed}");
        read.extend(x.pieces.iter().filter(|p| p.read.is_some()).map(|p| p.text.clone()));
    }
    assert!(got.excerpts.windows(2).all(|w| w[0].end < w[1].start), "seed {seed}: windows overlap");
    // Each passage's text is inside a read piece (adjacent passages may share one piece).
    for p in &passages {
        let text = decode(p.start, p.end);
        assert!(read.iter().any(|r| r.contains(text.trim())), "seed {seed}: {text:?} not in {read:?}");
    }
    let opening = excerpts(&e.tokenizer, &file, doc, &[], AROUND)?;
    assert_eq!((opening.excerpts.len(), opening.excerpts[0].start), (1, 0));
    assert_eq!(opening.excerpts[0].end, OPENING.min(de - ds));
    let outside = Passage { start: de, end: de + 4, share: 1.0, part: None };
    let err = excerpts(&e.tokenizer, &file, doc, &[outside], AROUND).unwrap_err();
    assert!(err.to_string().contains("is not inside"), "{err}");
    Ok(())
}

/// The memory planner on the samples context with fixed bandwidths: the offloaded tier keeps
/// every layer in host memory and its step's terms are the method's own cost over each path;
/// the resident tier keeps as many whole layers as the device budget holds and decodes the
/// others from the file each step; a budget that holds no layer, or host memory below the
/// K/V, is a problem that names what would fit — unless the file tier's share of it can hold
/// the rows' keys and cache (a context twice the budget's room stays on disk).
#[test]
fn the_memory_planner_places_the_kv_and_prices_a_step() -> Result<()> {
    use folio_models::attention::cost::{CostInput, Shape};
    use folio_models::attention::{MethodChoice, Tier};
    use folio_models::plan::{self, Bandwidths, Budgets, ModelFacts};
    let e = engine("demo");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("samples.folio");
    build(&e, &e.plan_context(&sample_documents(), None, None)?, &out, KvDtype::Bf16, None);
    let file = context::ContextFile::open(&out)?;
    let h = file.header();
    let cfg = e.config();
    let facts = ModelFacts { config: cfg, elem: 4, weights: None, weights_host: 0 };
    let bw = Bandwidths { device: 4e9, link: Some(1e9), host: 2e9, disk: None };
    let layer = (2 * h.kv_heads * h.tokens * h.head_dim * 4) as u64;
    let (total, read) = plan::parameters(cfg);
    assert_eq!(total, e.model.parameters(), "the planner counts the weights the model has");

    let hip = MethodChoice::parse("hip:64").unwrap();
    let p = plan::plan(&facts, h, &hip, Tier::Offloaded, Budgets::default(), &bw)?;
    // The file, read in place, is what the host holds for the K/V; its K/V sections (bf16) are
    // what a row costs on the link. The host's total adds the rest of the process.
    let file_kv = (h.layers * 2 * h.kv_heads * h.tokens * h.head_dim * 2) as u64;
    assert!(h.file_bytes > file_kv);
    assert_eq!((p.kv_host_bytes, p.kv_device_bytes, p.resident_layers, p.kv_on_disk), (h.file_bytes, 0, 0, false));
    assert!(p.process_host_bytes > 0 && p.method_host_bytes == 0);
    assert_eq!(p.host_bytes, p.kv_host_bytes + p.process_host_bytes);
    assert_eq!(p.host_budget, folio_runtime::host_budget::budget());
    let params = hip.params()?;
    let cost = (hip.spec()?.cost)(&CostInput {
        shape: Shape::of(cfg),
        context: h.tokens,
        elem: 4,
        budget: 64,
        params: &params,
        fp8_rows: false,
    });
    assert!((ms_of(&p, "device") - ((read * 4) as f64 + cost.device_bytes) / 4e9 * 1e3).abs() < 1e-9);
    assert!((ms_of(&p, "link") - cost.link_bytes / 2.0 / 1e9 * 1e3).abs() < 1e-9, "bf16 rows cross, not f32");
    assert_eq!(p.floor_ms, p.terms.iter().map(|t| t.ms).fold(0.0, f64::max));
    assert!(p.problems.is_empty(), "{:?}", p.problems);

    // Resident, with room for two layers beside the weights and the method's state.
    let weights = (total * 4) as u64;
    let two = Budgets { device: Some(weights + cost.resident_bytes + 2 * layer + layer / 2), host: None };
    let p = plan::plan(&facts, h, &hip, Tier::Resident, two, &bw)?;
    assert_eq!((p.resident_layers, p.kv_device_bytes), (2, 2 * layer));
    let again = (h.layers - 2) as f64;
    assert!((ms_of(&p, "link") - again * layer as f64 / 1e9 * 1e3).abs() < 1e-9);
    assert!(p.problems.is_empty());
    // No room for a layer; host memory below the offloaded K/V.
    let tight = Budgets { device: Some(weights + layer / 2), host: Some(file_kv - 1) };
    let p = plan::plan(&facts, h, &hip, Tier::Resident, tight, &bw)?;
    assert!(p.problems[0].contains("one layer") && p.problems[0].contains("with offload on"), "{:?}", p.problems);
    assert!(plan::check(&p).is_err());
    let p = plan::plan(&facts, h, &hip, Tier::Offloaded, tight, &bw)?;
    assert!(p.problems[0].contains("host budget"), "{:?}", p.problems);
    // A budget that holds the file but not the rest of the process beside it; MagicPIG's
    // tables count to the host.
    let file_only = Budgets { device: None, host: Some(h.file_bytes + 1) };
    let p = plan::plan(&facts, h, &hip, Tier::Offloaded, file_only, &bw)?;
    assert!(p.problems[0].contains("the rest of Folio") && p.problems[0].contains("in all"), "{:?}", p.problems);
    // A million tokens of this shape with room for half its file beside the process: the rows
    // stay on disk (the file tier), its share of the room in host memory, no problem.
    let mut big = h.clone();
    big.tokens = 1 << 20;
    big.file_bytes = big.layers as u64 * big.kv_dtype.kv_bytes(big.kv_heads * big.tokens, big.head_dim);
    let b = folio_runtime::host_memory::rss().unwrap_or(0) + big.file_bytes / 2;
    let p = plan::plan(&facts, &big, &hip, Tier::Offloaded, Budgets { device: None, host: Some(b) }, &bw)?;
    assert!(p.kv_on_disk && p.problems.is_empty(), "{p:?}");
    // (The plan reads the process as it is then: other tests' holds come and go beside it.)
    let share = (b - p.process_host_bytes - p.weights_host_bytes) as f64 * folio_models::kv_cache::FILE_CACHE_SHARE;
    assert!(p.kv_host_bytes < big.file_bytes && p.kv_host_bytes.abs_diff(share as u64) <= 1 && p.host_bytes <= b);
    // With the disk measured, a step's reads the tier's memory misses are priced on it: the
    // link's rows at the share of the K/V not held, at the disk's rate.
    assert!(p.terms.iter().all(|t| t.path != "disk"), "no disk rate, no disk term");
    let disk_bw = Bandwidths { disk: Some(1e8), ..bw };
    let budgets = Budgets { device: None, host: Some(b) };
    let d = plan::plan(&facts, &big, &hip, Tier::Offloaded, budgets, &disk_bw)?;
    let miss = 1.0 - d.kv_host_bytes as f64 / big.file_bytes as f64;
    let link_bytes = d.terms.iter().find(|t| t.path == "link").map_or(0.0, |t| t.bytes);
    assert!((ms_of(&d, "disk") - link_bytes * miss / 1e8 * 1e3).abs() < 1e-6 && miss > 0.0, "{d:?}");
    assert!(d.floor_ms >= ms_of(&d, "disk"));
    let measured = bw.with_disk(&out)?.disk.expect("a rate");
    assert!(measured.is_finite() && measured > 0.0);
    let magicpig = MethodChoice::parse("magicpig:64").unwrap();
    let p = plan::plan(&facts, h, &magicpig, Tier::Offloaded, Budgets::default(), &bw)?;
    assert!(p.method_host_bytes > 0 && p.host_bytes > p.kv_host_bytes + p.method_host_bytes, "{p:?}");
    // On the file tier MagicPIG's bucket lists lie on disk beside the file: its host state is the
    // rest (run starts, norms, a layer's build), the link carries its whole sample, and the
    // disk term adds its reads of the lists to the rows' misses.
    let params = magicpig.params()?;
    let input =
        CostInput { shape: Shape::of(cfg), context: big.tokens, elem: 4, budget: 64, params: &params, fp8_rows: false };
    let cost = (magicpig.spec()?.cost)(&input);
    assert!(
        cost.host_state_on_disk > 0 && cost.host_state(true) < cost.host_state_bytes && cost.state_disk_bytes > 0.0
    );
    let p = plan::plan(&facts, &big, &magicpig, Tier::Offloaded, budgets, &disk_bw)?;
    assert!(p.kv_on_disk && p.method_host_bytes == cost.host_state(true), "{p:?}");
    let link_bytes = p.terms.iter().find(|t| t.path == "link").map_or(0.0, |t| t.bytes);
    let file_per_compute = big.file_bytes as f64 / (big.layers as u64 * layer * (1 << 20) / h.tokens as u64) as f64;
    assert!((link_bytes - cost.file_link_bytes.expect("its own") * file_per_compute).abs() < 1.0, "{p:?}");
    let miss = 1.0 - p.kv_host_bytes as f64 / big.file_bytes as f64;
    assert!((ms_of(&p, "disk") - (link_bytes * miss + cost.state_disk_bytes) / 1e8 * 1e3).abs() < 1e-6, "{p:?}");
    Ok(())
}

fn ms_of(p: &folio_models::plan::Plan, path: &str) -> f64 {
    p.terms.iter().find(|t| t.path == path).map_or(0.0, |t| t.ms)
}
