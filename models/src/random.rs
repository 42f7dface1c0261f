//! Standard normal samples over the workspace's `rand` (Box–Muller), for what the engine draws
//! from a seed: the random-weight models of the benchmarks and MagicPIG's hyperplanes. A saved
//! MagicPIG index is redrawn from its seed, so this function is part of that index's format —
//! a change here changes every saved index's hashes (and the benchmarks' weights).

use rand::Rng;

/// One N(0, 1) sample.
pub fn normal(rng: &mut impl Rng) -> f32 {
    let (u, v): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random_range(0.0..1.0));
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}
