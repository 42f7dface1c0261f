//! Sparse attention methods against dense attention on the same KV, on synthetic decode steps
//! with the structure real attention has (a sink, a recent window, planted needles, a long
//! diffuse tail): tiny random models attend diffusely and would hide every difference.

use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

use folio_eval::workload::normal;
use folio_eval::workload::{Case, Spec};
use folio_models::attention::{by_name, parse_params, Attention, AttnCall, Channels, Dense, Resources};
use folio_models::kv_cache::ContextKv;
use folio_models::kv_cache::{DenseKv, KvStore, Reference};
use rand::{rngs::StdRng, Rng, SeedableRng};

// The kernels' shared test helpers (a replayable seed).
#[path = "../../kernels/tests/common/mod.rs"]
mod common;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const D: usize = 32;

/// One decode step: the query of the last position, and `len` keys/values where key 0 is a
/// sink, `needles` random earlier keys align with their head's query, the rest are noise.
struct Step {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    len: usize,
}

fn step(rng: &mut StdRng, len: usize, needles: usize) -> Step {
    let mut q = vec![0f32; HEADS * D];
    q.iter_mut().for_each(|x| *x = normal(rng));
    let mut k: Vec<f32> = (0..KV_HEADS * len * D).map(|_| 0.5 * normal(rng)).collect();
    let v: Vec<f32> = (0..KV_HEADS * len * D).map(|_| normal(rng)).collect();
    for kvh in 0..KV_HEADS {
        let qrow = &q[(kvh * (HEADS / KV_HEADS)) * D..][..D];
        // The sink: a key every query scores high.
        for (i, x) in k[(kvh * len) * D..][..D].iter_mut().enumerate() {
            *x = 1.5 * qrow[i].signum();
        }
        for _ in 0..needles {
            let pos = rng.random_range(1..len);
            for (i, x) in k[(kvh * len + pos) * D..][..D].iter_mut().enumerate() {
                *x = 0.6 * qrow[i];
            }
        }
    }
    Step {
        q: Tensor::from_vec(q, (HEADS, 1, D), &Device::Cpu).unwrap(),
        k: Tensor::from_vec(k, (KV_HEADS, len, D), &Device::Cpu).unwrap(),
        v: Tensor::from_vec(v, (KV_HEADS, len, D), &Device::Cpu).unwrap(),
        len,
    }
}

fn run(method: &dyn Attention, s: &Step, kv: &dyn KvStore, window: Option<usize>) -> Tensor {
    let call = AttnCall {
        layer: LAYER,
        layers: LAYERS,
        kv_layer: 0,
        q: &s.q,
        q_start: s.len - 1,
        kv,
        scale: 1.0 / (D as f32).sqrt(),
        window,
    };
    method.forward(&call).unwrap()
}

fn store(s: &Step) -> DenseKv {
    let mut kv = DenseKv::new(1, KV_HEADS, D, DType::F32, &Device::Cpu);
    kv.write(0, 0, &s.k, &s.v).unwrap();
    kv.set_len(s.len).unwrap();
    kv
}

fn rel_error(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    diff / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt()
}

fn method(name: &str, budget: &str, params: &[&str]) -> Box<dyn Attention> {
    let params: Vec<String> = params.iter().map(|s| s.to_string()).collect();
    by_name(name, Some(budget), &parse_params(&params).unwrap(), &Resources::default()).unwrap()
}

/// A budget covering every token makes each method dense: exactly (to f32 rounding of a
/// different reduction order), on one segment and across a saved prefix + tail, windowed too.
#[test]
fn full_budget_equals_dense() {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for case in 0..6 {
        let len = rng.random_range(50..400);
        let s = step(&mut rng, len, 3);
        let window = (case % 3 == 2).then(|| rng.random_range(8..s.len));
        // The same rows as a saved prefix and a one-token tail.
        let split = rng.random_range(1..s.len);
        let prefix = vec![(s.k.narrow(1, 0, split).unwrap(), s.v.narrow(1, 0, split).unwrap())];
        let mut two = ContextKv::from_layers(prefix, DType::F32, &Device::Cpu).unwrap();
        two.write(
            0,
            split,
            &s.k.narrow(1, split, s.len - split).unwrap(),
            &s.v.narrow(1, split, s.len - split).unwrap(),
        )
        .unwrap();
        two.set_len(s.len).unwrap();
        let one = store(&s);
        let dense = run(&Dense, &s, &one, window);
        let any_order = Arc::new(Channels::from_statistic(&vec![vec![vec![0.0; D]; KV_HEADS]; LAYERS]));
        let mut methods = every_method("100%", &any_order);
        methods.push(method("topk", "100%", &["window=0"]));
        for m in methods {
            for kv in [&one as &dyn KvStore, &two] {
                let e = rel_error(&run(m.as_ref(), &s, kv, window), &dense);
                assert!(e < 1e-5, "seed {seed} case {case}: {} differs from dense by {e}", m.settings());
            }
        }
    }
}

/// Top-k's selection is the brute-force one: the k largest raw scores per query head (against
/// its KV head), plus the window.
#[test]
fn topk_output_is_attention_over_the_true_top_keys() {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let s = step(&mut rng, 300, 5);
    let (k_budget, window) = (17, 6);
    let m = method("topk", &k_budget.to_string(), &[&format!("window={window}")]);
    let got = run(m.as_ref(), &s, &store(&s), None);
    // Brute force with plain loops, then dense attention over just those rows.
    let q = s.q.squeeze(1).unwrap().to_vec2::<f32>().unwrap();
    let k = s.k.to_vec3::<f32>().unwrap();
    let v = s.v.to_vec3::<f32>().unwrap();
    for (h, qh) in q.iter().enumerate() {
        let kvh = h / (HEADS / KV_HEADS);
        let cut = s.len - window;
        let mut order: Vec<usize> = (0..cut).collect();
        let score = |p: usize| k[kvh][p].iter().zip(qh).map(|(a, b)| a * b).sum::<f32>();
        order.sort_by(|a, b| score(*b).total_cmp(&score(*a)).then(a.cmp(b)));
        let mut sel: Vec<usize> = order[..k_budget].to_vec();
        sel.extend(cut..s.len);
        let scores: Vec<f64> = sel.iter().map(|&p| score(p) as f64 / (D as f64).sqrt()).collect();
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let expect: Vec<f32> = (0..D)
            .map(|i| sel.iter().zip(&w).map(|(&p, wi)| wi / total * v[kvh][p][i] as f64).sum::<f64>() as f32)
            .collect();
        let row = got.narrow(0, h, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let diff = row.iter().zip(&expect).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-5, "seed {seed}, head {h}: {diff}");
    }
}

/// Channels for Double Sparsity in these tests: calibrated on a held-out case of the workload.
fn channels(spec: &Spec) -> Arc<Channels> {
    let held_out = Case::generate(spec, 999).unwrap();
    let stat = held_out.qk_statistic().unwrap();
    Arc::new(Channels::from_statistic(&vec![stat; LAYERS]))
}

/// Layer index of the library workloads' calls: deep in a 32-layer model, past every method's
/// dense leading layers.
const LAYER: usize = 20;
const LAYERS: usize = 32;

fn every_method(budget: &str, channels: &Arc<Channels>) -> Vec<Box<dyn Attention>> {
    let r = Resources { channels: Some(channels.clone()) };
    ["streaming", "topk", "topk-ivf", "magicpig", "hip", "double-sparsity", "buzz"]
        .iter()
        .map(|m| by_name(m, Some(budget), &[], &r).unwrap())
        .collect()
}

/// Mean relative error of `m` over every decode step of `case`, in order (stateful methods
/// see the conversation progress), and the mean share of rows read.
fn case_error(m: &dyn Attention, case: &Case) -> (f32, f32) {
    let (err, read, _) = case_outcome(m, case);
    (err, read)
}

/// [`case_error`] and the fraction of the visible keys the search touched per query head, of
/// the method's CPU reference (the fast paths are held to it in tests/offload.rs).
fn case_outcome(m: &dyn Attention, case: &Case) -> (f32, f32, f64) {
    m.reset();
    let kv = Reference(case.store().unwrap());
    let (mut err, mut read, mut searched) = (0.0, 0.0, 0.0);
    for s in 0..case.queries.len() {
        let call = case.call(s, &kv, (LAYER, LAYERS));
        let got = m.attend(&call).unwrap();
        err += rel_error(&got.out, &Dense.forward(&call).unwrap());
        read += got
            .read
            .rows()
            .unwrap()
            .map_or(1.0, |r| r.iter().map(|h| h.len() as f32).sum::<f32>() / (r.len() * (call.q_start + 1)) as f32);
        searched += got.searched / (call.q_start + 1) as f64;
    }
    let n = case.queries.len();
    (err / n as f32, read / n as f32, searched / n as f64)
}

/// More budget, less error, down to dense at 100%, for every method on the mixed workload
/// (sink, locality, needles, long tail), averaged over fresh cases.
#[test]
fn error_falls_with_budget() {
    let seed = common::seed();
    let spec = Spec::mixed(1500);
    let cases: Vec<Case> = (0..3).map(|i| Case::generate(&spec, seed + i).unwrap()).collect();
    let ch = channels(&spec);
    let budgets = ["1%", "5%", "20%", "60%", "100%"];
    let per_budget: Vec<Vec<Box<dyn Attention>>> = budgets.iter().map(|b| every_method(b, &ch)).collect();
    for i in 0..per_budget[0].len() {
        let errs: Vec<f32> = per_budget
            .iter()
            .map(|ms| cases.iter().map(|c| case_error(ms[i].as_ref(), c).0).sum::<f32>() / cases.len() as f32)
            .collect();
        let name = per_budget[0][i].name();
        println!("{name:<16} relative error at 1/5/20/60/100% = {errs:.4?}");
        // Statistically falling: no step up by more than 10% (sampling and search noise).
        assert!(errs.windows(2).all(|w| w[1] <= w[0] * 1.1 + 1e-5), "seed {seed}: {name} errors do not fall: {errs:?}");
        assert!(errs[4] < 1e-5, "seed {seed}: {name} at 100% is not dense: {errs:?}");
        assert!(errs[0] > 1.5 * errs[3].max(1e-6), "seed {seed}: {name} barely improves: {errs:?}");
    }
    let at = |name: &str| {
        let m = by_name(name, Some("5%"), &[], &Resources::default()).unwrap();
        cases.iter().map(|c| case_error(m.as_ref(), c).0).sum::<f32>()
    };
    assert!(at("topk") < at("streaming"), "seed {seed}");
}

/// Double Sparsity with every channel, unquantized labels and no window is exact top-k.
#[test]
fn double_sparsity_with_all_channels_is_topk() {
    let seed = common::seed();
    let spec = Spec::needles(800);
    let case = Case::generate(&spec, seed).unwrap();
    let r = Resources { channels: Some(channels(&spec)) };
    let p = |items: &[&str]| parse_params(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    for budget in ["3%", "17", "40%"] {
        let ds = by_name("double-sparsity", Some(budget), &p(&["channels=32", "bits=16"]), &r).unwrap();
        let topk = by_name("topk", Some(budget), &p(&["window=0"]), &r).unwrap();
        assert_eq!(case_error(ds.as_ref(), &case), case_error(topk.as_ref(), &case), "seed {seed} at {budget}");
    }
    // Fewer channels and 4-bit labels still find most of the mass here (outlier channels).
    let ds = by_name("double-sparsity", Some("5%"), &[], &r).unwrap();
    let topk = by_name("topk", Some("5%"), &p(&["window=0"]), &r).unwrap();
    let window = by_name("streaming", Some("5%"), &[], &r).unwrap();
    // Summed over a few draws: one draw's ratio ranges widely (0.52 was seen once, seed
    // 8649853464862526554, where most draws stay under 0.32).
    let (mut e_ds, mut e_topk, mut e_window) = (0.0, 0.0, 0.0);
    for draw in 0..DS_DRAWS {
        let case = Case::generate(&spec, seed.wrapping_add(draw)).unwrap();
        e_ds += case_error(ds.as_ref(), &case).0;
        e_topk += case_error(topk.as_ref(), &case).0;
        e_window += case_error(window.as_ref(), &case).0;
    }
    println!("5%: double-sparsity {e_ds:.4}, exact top-k {e_topk:.4}, streaming {e_window:.4} ({DS_DRAWS} draws)");
    // Relative to the window of the same budget, not an absolute bound: the absolute error
    // spans 0.05 to 0.55 over draws.
    assert!(e_ds < 0.5 * e_window, "seed {seed}: double sparsity {e_ds}, streaming {e_window}");
}

/// Draws the 4-bit Double Sparsity check sums its errors over.
const DS_DRAWS: u64 = 4;

/// The IVF index scanning every list is the exact scan; probing few lists reads few keys.
#[test]
fn ivf_with_every_list_probed_is_exact_topk() {
    let seed = common::seed();
    let case = Case::generate(&Spec::mixed(3000), seed).unwrap();
    let r = Resources::default();
    let p = |items: &[&str]| parse_params(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let all = by_name("topk-ivf", Some("2%"), &p(&["nlist=16", "nprobe=16"]), &r).unwrap();
    let exact = by_name("topk", Some("2%"), &[], &r).unwrap();
    assert_eq!(case_error(all.as_ref(), &case), case_error(exact.as_ref(), &case), "seed {seed}");
    let few = by_name("topk-ivf", Some("2%"), &p(&["nlist=16", "nprobe=2"]), &r).unwrap();
    let ((e_few, _, s_few), (e_exact, _, s_exact)) =
        (case_outcome(few.as_ref(), &case), case_outcome(exact.as_ref(), &case));
    println!(
        "2%: ivf nprobe 2/16 error {e_few:.4} scoring {s_few:.3} of the keys, exact {e_exact:.4} scoring {s_exact:.3}"
    );
    // The exact scan keeps the most attention mass a budget can; two lists of sixteen score
    // about an eighth of the keys (lists are uneven, hence the margin). How much error that
    // costs depends on the draw (0.1 to 1.9 over seeds), so it is printed, not bounded.
    assert!(e_few >= e_exact - 1e-6, "seed {seed}: {e_few} vs {e_exact}");
    assert!(s_few < 0.4 * s_exact, "seed {seed}: probing 2 of 16 lists scored {s_few} of the keys, the scan {s_exact}");
}

/// HiP with k covering the searched region, and MagicPIG with every token static (a window
/// over the whole context), are dense attention.
#[test]
fn hip_and_magicpig_limits_are_dense() {
    let seed = common::seed();
    let case = Case::generate(&Spec::locality(600), seed).unwrap();
    let r = Resources::default();
    let p = |items: &[&str]| parse_params(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let hip = by_name("hip", Some("700"), &p(&["block=4"]), &r).unwrap();
    let pig = by_name("magicpig", Some("1%"), &p(&["window=100000"]), &r).unwrap();
    for m in [hip, pig] {
        let (err, read) = case_error(m.as_ref(), &case);
        assert!(err < 1e-5 && read == 1.0, "seed {seed}: {} {err} {read}", m.name());
    }
}
