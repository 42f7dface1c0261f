#!/usr/bin/env python3
"""Does a per-channel scale make fp8 (e4m3) keys more accurate than a per-row scale?

docs/context-file.md ("Storage dtypes") quotes this: random keys whose channel magnitudes span
100x (the outlier channels KIVI scales per channel), quantized to e4m3 with one scale per row
(Folio's codec) and with one scale per channel, and the error each puts on q.k logits. e4m3's
error is relative (3 mantissa bits), so the scale's granularity matters only near the
subnormal range; integer formats, whose step is absolute, are where per-channel scales pay.

    python3 tools/fp8_scales.py [--seeds 16]
"""

import argparse

import numpy as np

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANTISSA_BITS = 3


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value (subnormals included), saturating at +-448."""
    e = np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))), E4M3_MIN_NORMAL_EXP)
    step = 2.0 ** (e - E4M3_MANTISSA_BITS)
    return np.clip(np.round(x / step) * step, -E4M3_MAX, E4M3_MAX)


def quantized(k: np.ndarray, axis: int) -> np.ndarray:
    """Scale so that the max |value| along `axis` maps to 448, round, scale back."""
    s = np.abs(k).max(axis=axis, keepdims=True) / E4M3_MAX
    return e4m3(k / s) * s


def errors(seed: int, keys: int, dim: int) -> dict:
    """Max |logit error| / logit range of each scale choice on one random draw."""
    rng = np.random.default_rng(seed)
    channel = np.exp(rng.uniform(np.log(0.05), np.log(5.0), dim))
    k = rng.standard_normal((keys, dim)) * channel
    q = rng.standard_normal(dim) / channel * 3.0
    exact = k @ q
    return {name: np.abs(quantized(k, axis) @ q - exact).max() / (exact.max() - exact.min())
            for name, axis in (("per row", 1), ("per channel", 0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16, help="random draws (seeds 0..N-1)")
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=32)
    a = ap.parse_args()
    runs = [errors(seed, a.keys, a.dim) for seed in range(a.seeds)]
    for name in runs[0]:
        e = 100 * np.array([r[name] for r in runs])
        print(f"scale {name:<11}: max |logit error| / range, mean {e.mean():.2f}% (min {e.min():.2f}%, "
              f"max {e.max():.2f}%) over {a.seeds} draws")


if __name__ == "__main__":
    main()
