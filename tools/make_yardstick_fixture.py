#!/usr/bin/env python3
"""A tiny random-weight model with the yardstick's language, for the suite's tests.

    python3 tools/make_yardstick_fixture.py [OUT]   (default tests/fixtures/models/yardstick-tiny)

The RULER-style suite (eval/src/ruler.rs) builds prompts from a model's eval_spec.json, tokenizer
and chat template; its tests need a model folder that Folio loads with the yardstick's
vocabulary and spec before the yardstick itself is trained. This one has the yardstick's
vocabulary, tokenizer, template and spec (tools/yardstick_tasks.py, the single source) and two
layers of seeded random float32 weights (uniform, from PCG64's raw bits) in the yardstick's head grouping (7 query heads per K/V
head), written with numpy alone (no torch), so any machine regenerates it byte for byte.
tools/test_yardstick.py checks that the committed folder is what this script makes.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import demo_grammar as G  # noqa: E402
import yardstick_tasks as Y  # noqa: E402
from demo_data import MAX_POS, ROPE_THETA  # noqa: E402
from train_demo import write_static_files  # noqa: E402

DEFAULT_OUT = HERE.parent / "tests/fixtures/models/yardstick-tiny"
SHAPE = {"layers": 2, "hidden": 56, "heads": 7, "kv_heads": 1, "head_dim": 8, "intermediate": 96}
SEED = 49


def config(vocab: list[str]) -> dict:
    ids = {t: vocab.index(t) for t in G.SPECIALS}
    s = SHAPE
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab),
        "hidden_size": s["hidden"], "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-5, "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "bos_token_id": ids[G.BOS], "eos_token_id": [ids[G.END], ids[G.EOS]], "pad_token_id": ids[G.PAD],
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "dtype": "float32",
    }


def weights(vocab: list[str]) -> dict[str, np.ndarray]:
    s, rng = SHAPE, np.random.default_rng(SEED)
    h, q, kv, m = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["intermediate"]

    def w(*shape):
        # uniform in [-0.35, 0.35) from PCG64's raw stream, which numpy keeps stable across
        # versions (its distributions it does not promise to), so the bytes are the same anywhere
        raw = rng.bit_generator.random_raw(int(np.prod(shape)))
        return (((raw >> np.uint64(11)).astype(np.float64) * 2.0**-53 - 0.5) * 0.7).astype(np.float32).reshape(shape)

    out = {"model.embed_tokens.weight": w(len(vocab), h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(m, h), p + "mlp.up_proj.weight": w(m, h),
            p + "mlp.down_proj.weight": w(h, m),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    out["model.norm.weight"] = np.ones(h, np.float32)
    out["lm_head.weight"] = w(len(vocab), h)
    return out


def safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    """The safetensors layout: a little-endian u64 header size, the JSON header, the data."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        b = tensors[name].astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def make(out: Path) -> None:
    vocab = Y.vocabulary()
    write_static_files(out, vocab, Y.eval_spec())
    (out / "config.json").write_text(json.dumps(config(vocab), indent=2) + "\n")
    (out / "model.safetensors").write_bytes(safetensors(weights(vocab)))


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
