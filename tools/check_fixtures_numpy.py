#!/usr/bin/env python3
"""Independent float64 NumPy re-implementation of the four fixture models.

Reads tests/fixtures/models/<name>/{config.json,*.safetensors,reference.json}
(written by tools/make_fixtures.py) and recomputes, without torch or
transformers, the reference logits, the perplexity values and the greedy
tokens. It is an executable statement of the conventions the Rust engine must
follow:

* RMSNorm: x / sqrt(mean(x^2) + eps) * weight
* rotary embedding: non-interleaved halves (rotate_half), inv_freq =
  theta^(-2i/head_dim); llama3 scaling per band of wavelength 2*pi/inv_freq:
  < old_ctx/high_freq_factor keep, > old_ctx/low_freq_factor divide by
  factor, in between smooth = (old_ctx/wavelen - low)/(high - low),
  inv = (1 - smooth) * inv/factor + smooth * inv
* Qwen3: per-head RMSNorm (q_norm / k_norm) on q and k BEFORE rope
* GQA: query head h uses kv head h // (n_heads / n_kv_heads)
* scores scaled by head_dim^-0.5; causal mask j <= i; sliding window (mistral):
  key j visible from query i iff i - j < sliding_window
* MLP: down(silu(gate(x)) * up(x)); tied lm_head = embed_tokens (qwen2)
* perplexity: mean NLL over the len-1 next-token predictions

Usage: python3 tools/check_fixtures_numpy.py [tests/fixtures/models]
Needs numpy and safetensors only. Exits non-zero on a mismatch.
"""

import glob
import json
import math
import os
import sys

import numpy as np
from safetensors import safe_open


def load_weights(d):
    w = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(f, "np") as s:
            for k in s.keys():
                w[k] = s.get_tensor(k).astype(np.float64)
    return w


def rope_inv_freq(cfg, head_dim):
    rp = cfg.get("rope_parameters")
    if rp is None:  # classic config style
        rp = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg["rope_theta"])
    inv = 1.0 / rp["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    if rp.get("rope_type", rp.get("type", "default")) == "llama3":
        f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(mid, smoothed, scaled)
    return inv


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def apply_rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin


def forward(d, ids, w=None, cfg=None):
    """Logits of `ids` for the model in folder `d` (or of weights `w` with config `cfg`)."""
    cfg = cfg or json.load(open(os.path.join(d, "config.json")))
    w = w if w is not None else load_weights(d)
    n_h, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // n_h
    eps, t = cfg["rms_norm_eps"], len(ids)
    freqs = np.arange(t)[:, None] * rope_inv_freq(cfg, hd)[None]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    visible = j <= i
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window:
        visible &= (i - j) < window
    x = w["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer

        def lin(name, v):
            y = v @ w[p + name + ".weight"].T
            return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin("self_attn.q_proj", h).reshape(t, n_h, hd).transpose(1, 0, 2)
        k = lin("self_attn.k_proj", h).reshape(t, n_kv, hd).transpose(1, 0, 2)
        v = lin("self_attn.v_proj", h).reshape(t, n_kv, hd).transpose(1, 0, 2)
        if p + "self_attn.q_norm.weight" in w:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = np.repeat(k, n_h // n_kv, 0), np.repeat(v, n_h // n_kv, 0)
        s = np.where(visible[None], q @ k.transpose(0, 2, 1) / math.sqrt(hd), -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + (s @ v).transpose(1, 0, 2).reshape(t, n_h * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g, u = lin("mlp.gate_proj", h), lin("mlp.up_proj", h)
        x = x + lin("mlp.down_proj", g / (1 + np.exp(-g)) * u)
    x = rms_norm(x, w["model.norm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def mean_nll(logits, ids):
    z = logits - logits.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-lp[np.arange(len(ids) - 1), ids[1:]].mean())


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/models"
    ok = True
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        ref_path = os.path.join(d, "reference.json")
        if not os.path.isfile(ref_path):
            continue
        ref = json.load(open(ref_path))
        lg = forward(d, ref["logits"]["input_ids"])
        err = float(np.abs(lg - np.array(ref["logits"]["values"])).max())
        pid = ref["perplexity"]["input_ids"]
        nll = mean_nll(forward(d, pid), pid)
        n40 = ref["perplexity_max_tokens"]["max_tokens"]
        nll40 = mean_nll(forward(d, pid[:n40]), pid[:n40])
        seq, new = list(ref["greedy"]["prompt_ids"]), []
        for _ in ref["greedy"]["new_tokens"]:
            new.append(int(forward(d, seq)[-1].argmax()))
            seq.append(new[-1])
        good = (err < 1e-4 and abs(nll - ref["perplexity"]["mean_nll"]) < 1e-4
                and abs(nll40 - ref["perplexity_max_tokens"]["mean_nll"]) < 1e-4
                and new == ref["greedy"]["new_tokens"])
        ok &= good
        print("%-8s %s  max|logit diff|=%.2e  nll %.6f (ref %.6f)  nll40 %.6f (ref %.6f)  greedy %s"
              % (name, "OK  " if good else "FAIL", err, nll, ref["perplexity"]["mean_nll"],
                 nll40, ref["perplexity_max_tokens"]["mean_nll"],
                 "same" if new == ref["greedy"]["new_tokens"] else "DIFFERENT"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
