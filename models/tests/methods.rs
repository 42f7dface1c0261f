//! Sparse attention methods against dense attention on the same KV, on synthetic decode steps
//! with the structure real attention has (a sink, a recent window, planted needles, a long
//! diffuse tail): tiny random models attend diffusely and would hide every difference.

use candle_core::{DType, Device, Tensor};
use folio_models::attention::{by_name, parse_params, Attention, AttnCall, Dense};
use folio_models::context::ContextKv;
use folio_models::kv::{DenseKv, KvStore};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr_free::normal;

/// Gaussian samples without another crate: Box-Muller over the workspace's `rand`.
mod rand_distr_free {
    use rand::Rng;
    pub fn normal(rng: &mut impl Rng) -> f32 {
        let (u, v): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random_range(0.0..1.0));
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

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
    let call =
        AttnCall { layer: 0, kv_layer: 0, q: &s.q, q_start: s.len - 1, kv, scale: 1.0 / (D as f32).sqrt(), window };
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
    by_name(name, Some(budget), &parse_params(&params).unwrap()).unwrap()
}

/// A budget covering every token makes each method dense: exactly (to f32 rounding of a
/// different reduction order), on one segment and across a saved prefix + tail, windowed too.
#[test]
fn full_budget_equals_dense() {
    let seed = rand::random();
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
        for m in [method("topk", "100%", &["window=0"]), method("topk", "100%", &[]), method("streaming", "100%", &[])]
        {
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
    let seed = rand::random();
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

/// More budget, less error, down to dense at 100%; top-k beats streaming at equal budget when
/// the mass sits on needles in the middle.
#[test]
fn error_falls_with_budget() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let steps: Vec<Step> = (0..8).map(|_| step(&mut rng, 1000, 6)).collect();
    let mean_error = |m: &dyn Attention| -> f32 {
        steps.iter().map(|s| rel_error(&run(m, s, &store(s), None), &run(&Dense, s, &store(s), None))).sum::<f32>()
            / steps.len() as f32
    };
    for name in ["topk", "streaming"] {
        let errs: Vec<f32> =
            ["1%", "5%", "20%", "60%", "100%"].iter().map(|b| mean_error(method(name, b, &[]).as_ref())).collect();
        println!("{name}: relative error at 1/5/20/60/100% = {errs:?}");
        assert!(errs.windows(2).all(|w| w[1] <= w[0] + 1e-6), "seed {seed}: {name} errors do not fall: {errs:?}");
        assert!(errs[4] < 1e-5 && errs[0] > 10.0 * errs[4].max(1e-7), "seed {seed}: {name}: {errs:?}");
    }
    let at = |name: &str| mean_error(method(name, "5%", &[]).as_ref());
    assert!(at("topk") < at("streaming"), "seed {seed}");
}
