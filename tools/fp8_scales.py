#!/usr/bin/env python3
"""Does a per-channel scale make fp8 (e4m3) keys more accurate than a per-row scale?

docs/context-file.md ("Storage dtypes") quotes this: random keys whose channel magnitudes span
100x (the outlier channels KIVI scales per channel), quantized to e4m3 with one scale per row
(Folio's codec) and with one scale per channel, and the error each puts on q.k logits. e4m3's
error is relative (3 mantissa bits), so the scale's granularity matters only near the
subnormal range; integer formats, whose step is absolute, are where per-channel scales pay.

    python3 tools/fp8_scales.py [--seed 0]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=32)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    channel = np.exp(rng.uniform(np.log(0.05), np.log(5.0), a.dim))
    k = rng.standard_normal((a.keys, a.dim)) * channel
    q = rng.standard_normal(a.dim) / channel * 3.0
    exact = k @ q
    for name, axis in (("per row", 1), ("per channel", 0)):
        err = np.abs(quantized(k, axis) @ q - exact).max() / (exact.max() - exact.min())
        print(f"scale {name:<11}: max |logit error| / range {100 * err:.2f}%")


if __name__ == "__main__":
    main()
