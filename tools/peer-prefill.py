#!/usr/bin/env python3
"""Peer run for issue #19: Hugging Face transformers prefilling the shape Folio prefills.

`folio bench prefill --shape` times Folio's prefill of a model shape with random weights. This
script times transformers prefilling the same shape with random bf16 weights, at the same token
counts and on the same GPU. Each run is one forward with `use_cache=True` that computes the
logits of the last row only. The DynamicCache it leaves is the product, as Folio's context file
is. The script builds one model per attention implementation (default sdpa and
flash_attention_2). It reports the same FLOP count as Folio and the same ratio to a measured
bf16 GEMM rate. With --folio, it sets Folio's tokens/s beside each peer's.

On the device machine (PyTorch + transformers, no internet; .gpu/folio from tools/gpu-smoke.sh):

    .gpu/folio bench prefill --shape assets/shapes/qwen2.5-7b-instruct-1m.json \\
        --tokens 32768,131072 --kv-dtype fp8 --vram-budget 24GiB --device cuda --json > $OUT/folio.json
    python3 tools/peer-prefill.py --shape assets/shapes/qwen2.5-7b-instruct-1m.json \\
        --tokens 32768,131072 --folio $OUT/folio.json --json $OUT/peer.json

Where the two differ: the peer keeps bf16 K/V in GPU memory in one pass, while Folio writes its
context file in chunks under its memory budget, with the K/V dtype given. Folio's peak memory is
the driver's (total - free, CUDA context and allocator cache included). The peer's peaks are
torch's max_memory_allocated and max_memory_reserved, which leave the CUDA context out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import inspect
import json
import re
import statistics
import sys
import time
from pathlib import Path

DEFAULT_ATTN = "sdpa,flash_attention_2"
FLASH_ATTENTION_2 = "flash_attention_2"
# Shape keys the FLOP count and the model need (models/src/config.rs requires the same).
REQUIRED_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "vocab_size")
# Tokens of the untimed forward that loads the kernels and sizes cuBLAS's workspace.
WARMUP_TOKENS = 1024
# The GEMM Folio's `matmul_flops` times on a GPU (GEMM_SIDE and REPS in eval/src/bench/mod.rs).
GEMM_SIDE = 4096
GEMM_CALLS = 50
# Standard deviation of the random weights (transformers' usual initializer_range).
INIT_STD = 0.02
# attn_implementation in from_config came with transformers 4.36; 4.56 renamed torch_dtype to dtype.
MIN_TRANSFORMERS = (4, 36)
DTYPE_KWARG_SINCE = (4, 56)
# What CUDA, cuBLAS and flash-attn say when an allocation fails.
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
GIB = 1 << 30
TERA = 1e12


def token_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not counts or min(counts) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return counts


def attn_names(text: str) -> list[str]:
    found = [t.strip() for t in text.split(",") if t.strip()]
    if not found:
        raise argparse.ArgumentTypeError("expected comma-separated attention implementations")
    return found


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time transformers prefilling a model shape (random bf16 weights) on this GPU, "
        "the peer of `folio bench prefill --shape`.",
        epilog="example:\n  python3 tools/peer-prefill.py --shape assets/shapes/qwen2.5-7b-instruct-1m.json \\\n"
        "      --tokens 32768,131072 --folio folio.json --json peer.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", type=Path, required=True, help="a model shape, e.g. assets/shapes/*.json")
    p.add_argument("--tokens", type=token_counts, required=True, help="prompt lengths, comma-separated")
    p.add_argument("--attn", type=attn_names, default=attn_names(DEFAULT_ATTN),
                   help=f"transformers attn_implementation values, comma-separated (default {DEFAULT_ATTN})")
    p.add_argument("--folio", type=Path, help="the stdout of `folio bench prefill --json`, to compare with")
    p.add_argument("--json", type=Path, help="write the full results here as JSON")
    p.add_argument("--repeats", type=int, default=1, help="timed prefills per token count (default 1)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def load_shape(path: Path) -> dict:
    """The shape's config fields, without the keys that start with "_" (notes such as "_source")."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        sys.exit(f"shape file {path} not found (the shapes are in assets/shapes/)")
    except json.JSONDecodeError as e:
        sys.exit(f"shape file {path} is not valid JSON: {e}")
    if not isinstance(doc, dict):
        sys.exit(f"shape file {path} is not a JSON object like a config.json")
    missing = [k for k in REQUIRED_SHAPE_KEYS if k not in doc]
    if missing:
        sys.exit(f"shape file {path} lacks {', '.join(missing)}")
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def load_folio(path: Path) -> dict:
    """The JSON document of `folio bench prefill --json` (keys: PrefillReport and Row in eval/src/bench/prefill.rs)."""
    hint = "it should hold the stdout of `folio bench prefill --json`"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        sys.exit(f"--folio {path} not found")
    except json.JSONDecodeError as e:
        sys.exit(f"--folio {path} is not valid JSON ({e}); {hint}")
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        sys.exit(f"--folio {path} has no \"rows\" list; {hint}")
    for row in rows:
        if not isinstance(row, dict) or "tokens" not in row or "tokens_per_s" not in row:
            sys.exit(f"--folio {path}: a row lacks \"tokens\" or \"tokens_per_s\": {row!r}")
    return doc


def prefill_flops(shape: dict, n: int) -> float:
    """FLOPs of prefilling n tokens. This is the formula of Folio's `prefill_flops`
    (eval/src/bench/prefill.rs), so both runs divide the same work by their seconds. Per layer and
    token it counts the Q/K/V and output projections and the three MLP matmuls. Attention is
    QK^T and PV over the causal half of the n x n scores. The last term is the LM head of one row.
    Absent num_key_value_heads and head_dim default as in models/src/config.rs."""
    heads = shape["num_attention_heads"]
    kv_heads = shape.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = shape.get("head_dim")
    head_dim = shape["hidden_size"] // heads if head_dim is None else head_dim
    h = float(shape["hidden_size"])
    q = float(heads * head_dim)
    kv = float(kv_heads * head_dim)
    i = float(shape["intermediate_size"])
    per_token_layer = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i)
    attention = 2.0 * 2.0 * q * n * n / 2.0
    return shape["num_hidden_layers"] * (per_token_layer * n + attention) + 2.0 * h * shape["vocab_size"]


def version_tuple(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        sys.exit(f"cannot read the transformers version {version!r}")
    return int(m.group(1)), int(m.group(2))


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def sdpa_backends() -> dict:
    """Which of torch's scaled_dot_product_attention backends are enabled."""
    import torch

    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    if hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        flags["cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()
    return flags


def gemm_flops_per_s() -> float:
    """FLOP/s of a bf16 GEMM_SIDE-square matmul, as Folio's `matmul_flops`: one warm-up, then
    GEMM_CALLS calls timed together."""
    import torch

    a = torch.randn(GEMM_SIDE, GEMM_SIDE, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(GEMM_CALLS):
        torch.matmul(a, a)
    torch.cuda.synchronize()
    return 2.0 * GEMM_SIDE**3 / ((time.perf_counter() - start) / GEMM_CALLS)


def build_config(shape: dict):
    import transformers

    fields = dict(shape)
    model_type = fields.pop("model_type")
    # Folio prefills a Qwen shape with use_sliding_window false with full attention
    # (models/src/config.rs). Some transformers 4.x versions still read `sliding_window` when
    # they build the SDPA mask. Beyond the window they then build an n x n mask (32 GiB at 128k).
    # None means full attention to every version.
    if fields.get("use_sliding_window") is False:
        fields["sliding_window"] = None
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        sys.exit(f"transformers {transformers.__version__} cannot build a {model_type!r} config: {e}")


def skip_hf_init():
    """transformers' no_init_weights, where it has one: it skips _init_weights (and, in newer
    versions, torch.nn.init). fill_random draws every parameter afterwards anyway."""
    from transformers import modeling_utils

    no_init = getattr(modeling_utils, "no_init_weights", None)
    return no_init() if no_init else contextlib.nullcontext()


def fill_random(model) -> None:
    """Matrices N(0, INIT_STD), biases 0, norm weights 1. Speed depends on the shape alone."""
    import torch

    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=INIT_STD)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.ones_(p)


def build_model(cfg, attn: str):
    """The shape as a bf16 causal LM with random weights, created on the GPU, in eval mode."""
    import torch
    import transformers

    renamed = version_tuple(transformers.__version__) >= DTYPE_KWARG_SINCE
    dtype_kwarg = {"dtype" if renamed else "torch_dtype": torch.bfloat16}
    with skip_hf_init(), torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, **dtype_kwarg)
    fill_random(model)
    return model.eval()


def prefill_fn(model):
    """One prefill forward that keeps the KV cache and computes the logits of the last row only.
    Full [n, vocab] logits would take 80 GB at 128k tokens, and a prefill does not need them."""
    params = inspect.signature(model.forward).parameters
    for keep in ("logits_to_keep", "num_logits_to_keep"):
        if keep in params:
            return lambda ids: model(input_ids=ids, use_cache=True, **{keep: 1})
    base, head = model.base_model, model.get_output_embeddings()

    def last_row(ids):
        out = base(input_ids=ids, use_cache=True)
        return out.past_key_values, head(out.last_hidden_state[:, -1:, :])

    return last_row


def is_oom(e: RuntimeError) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or any(m in str(e) for m in OOM_MARKERS)


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def measure(run, n: int, vocab: int, repeats: int, shape: dict, gemm: float) -> dict:
    """One row: `repeats` timed prefills of n random tokens, or the out-of-memory error."""
    import torch

    # Blocks cached by an earlier row would count in this row's reserved peak.
    free_cuda()
    ids, error = None, None
    try:
        gen = torch.Generator(device="cuda").manual_seed(n)
        ids = torch.randint(0, vocab, (1, n), device="cuda", generator=gen)
        torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = run(ids)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            del out
    except RuntimeError as e:
        if not is_oom(e):
            raise
        error = str(e).splitlines()[0]
    del ids
    if error is not None:
        return {"tokens": n, "oom": True, "error": error}
    mean = statistics.fmean(seconds)
    flops = prefill_flops(shape, n) / mean
    return {
        "tokens": n,
        "seconds": seconds,
        "mean_seconds": mean,
        "median_seconds": statistics.median(seconds),
        "min_seconds": min(seconds),
        "tokens_per_s": n / mean,
        "flops_per_s": flops,
        "flops_ratio_to_matmul": flops / gemm,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


ROW_HEADER = (f"{'tokens':>8}  {'impl':<18} {'mean s':>9} {'median s':>9} {'tok/s':>9} {'TFLOP/s':>8} "
              f"{'÷ GEMM':>7} {'alloc GiB':>10} {'resv GiB':>9}")


def print_row(impl: str, row: dict) -> None:
    if row.get("oom"):
        print(f"{row['tokens']:>8}  {impl:<18} OOM: {row['error']}", flush=True)
        return
    print(
        f"{row['tokens']:>8}  {impl:<18} {row['mean_seconds']:>9.2f} {row['median_seconds']:>9.2f} "
        f"{row['tokens_per_s']:>9.0f} {row['flops_per_s'] / TERA:>8.1f} {100 * row['flops_ratio_to_matmul']:>6.1f}% "
        f"{row['peak_allocated_bytes'] / GIB:>10.1f} {row['peak_reserved_bytes'] / GIB:>9.1f}",
        flush=True,
    )


def bench_impl(cfg, attn: str, args: argparse.Namespace, shape: dict, gemm: float) -> dict:
    """Build the model with `attn`, warm it up, and time each token count. The model is freed
    when this returns."""
    import torch

    try:
        model = build_model(cfg, attn)
    except (ImportError, ValueError) as e:
        return {"skipped": f"transformers could not build it: {e}"}
    result = {
        "attn_implementation": model.config._attn_implementation,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": [],
    }
    run = prefill_fn(model)
    with torch.inference_mode():
        warm = torch.zeros(1, WARMUP_TOKENS, dtype=torch.long, device="cuda")
        out = run(warm)
        torch.cuda.synchronize()
        del out, warm
        for n in args.tokens:
            row = measure(run, n, cfg.vocab_size, args.repeats, shape, gemm)
            print_row(attn, row)
            result["rows"].append(row)
    return result


def comparison(folio: dict, results: dict, tokens: list[int]) -> list[dict]:
    """Per token count: Folio's tokens/s, each peer's, and Folio ÷ peer (>1: Folio is faster)."""
    folio_rows = {r["tokens"]: r for r in folio["rows"]}
    out = []
    for n in sorted(set(tokens) | set(folio_rows)):
        f = folio_rows.get(n)
        entry = {
            "tokens": n,
            "folio_tokens_per_s": f["tokens_per_s"] if f else None,
            "folio_peak_vram_bytes": f.get("peak_vram_bytes") if f else None,
            "peers": {},
        }
        for impl, res in results.items():
            row = next((r for r in res.get("rows", []) if r["tokens"] == n), None)
            if row is None:
                continue
            if row.get("oom"):
                entry["peers"][impl] = {"oom": True}
            else:
                entry["peers"][impl] = {
                    "tokens_per_s": row["tokens_per_s"],
                    "peak_reserved_bytes": row["peak_reserved_bytes"],
                    "folio_ratio": f["tokens_per_s"] / row["tokens_per_s"] if f else None,
                }
        out.append(entry)
    return out


def print_comparison(entries: list[dict], impls: list[str]) -> None:
    print("\nFolio ÷ peer tokens/s (>1 means Folio is faster)")
    print(f"{'tokens':>8}  {'peer':<18} {'Folio tok/s':>11} {'peer tok/s':>10} {'Folio÷peer':>10}")
    for e in entries:
        folio_tps = "—" if e["folio_tokens_per_s"] is None else f"{e['folio_tokens_per_s']:.0f}"
        for impl in impls:
            peer = e["peers"].get(impl)
            if peer is None:
                peer_tps, ratio = "—", "—"
            elif peer.get("oom"):
                peer_tps, ratio = "OOM", "—"
            else:
                peer_tps = f"{peer['tokens_per_s']:.0f}"
                ratio = "—" if peer["folio_ratio"] is None else f"{peer['folio_ratio']:.2f}"
            print(f"{e['tokens']:>8}  {impl:<18} {folio_tps:>11} {peer_tps:>10} {ratio:>10}")


def main() -> None:
    args = parse_args()
    shape = load_shape(args.shape)
    folio = load_folio(args.folio) if args.folio else None

    import torch
    import transformers
    from transformers.utils import is_flash_attn_2_available

    if version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} is too old: attn_implementation needs "
                 f"{'.'.join(map(str, MIN_TRANSFORMERS))} or newer")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this peer run times the GPU that Folio ran on")

    gemm = gemm_flops_per_s()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": str(args.shape),
        "model_type": shape["model_type"],
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "flash_attn": package_version("flash_attn"),
        "sdpa_backends": sdpa_backends(),
        "dtype": "bfloat16",
        "repeats": args.repeats,
        "warmup_tokens": WARMUP_TOKENS,
    }
    print(f"{meta['gpu']}: torch {meta['torch']} (CUDA {meta['cuda']}), transformers {meta['transformers']}, "
          f"flash_attn {meta['flash_attn'] or 'absent'}; SDPA backends {meta['sdpa_backends']}")
    print(f"bf16 GEMM {GEMM_SIDE}³: {gemm / TERA:.1f} TFLOP/s")
    if folio:
        folio_gemm = folio.get("matmul_flops_per_s")
        folio_gemm = "?" if folio_gemm is None else f"{folio_gemm / TERA:.1f}"
        print(f"Folio's run: {folio.get('device', '?')}, bf16 GEMM {folio_gemm} TFLOP/s")
        layers = shape["num_hidden_layers"]
        for r in folio["rows"]:
            if r.get("layers_computed", layers) != layers:
                print(f"note: Folio's row of {r['tokens']} tokens computed {r['layers_computed']} of {layers} "
                      "layers (a resumed run), so its tokens/s is not that of a whole prefill")
    print(f"\n{ROW_HEADER}")

    cfg = build_config(shape)
    results = {}
    for attn in args.attn:
        if attn == FLASH_ATTENTION_2 and not is_flash_attn_2_available():
            results[attn] = {"skipped": "the flash_attn package is not importable"}
        else:
            results[attn] = bench_impl(cfg, attn, args, shape, gemm)
            free_cuda()
        if "skipped" in results[attn]:
            print(f"{'':>8}  {attn:<18} skipped: {results[attn]['skipped']}", flush=True)

    doc = {"meta": meta, "matmul_flops_per_s": gemm, "impls": results}
    if folio:
        doc["comparison"] = comparison(folio, results, args.tokens)
        print_comparison(doc["comparison"], [a for a in args.attn if "rows" in results[a]])
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
