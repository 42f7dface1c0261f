#!/usr/bin/env python3
"""A numpy-only reference forward pass of the demo model, for CPU checks without torch.

    python3 tools/demo_numpy.py assets/models/demo --doc assets/samples/field_notes.txt \
        --ask "what is the secret code of amber falcon ?"

Reads config.json, model.safetensors (bf16 or f32) and tokenizer.json; builds the chat prompt
the way docs/demo-model.md describes (documents in the system message, one
"<|doc|> title : {title} ." header per document, the question in the user message) and decodes
greedily. Slow (full recompute per token) but fine for a few thousand tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        buf = raw[base + a:base + b]
        if t["dtype"] == "BF16":
            u = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif t["dtype"] == "F32":
            arr = np.frombuffer(buf, dtype=np.float32)
        else:
            raise ValueError(t["dtype"])
        out[name] = arr.reshape(t["shape"]).astype(np.float32)
    return out


class Llama:
    def __init__(self, model_dir: Path):
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_safetensors(model_dir / "model.safetensors")
        c = self.cfg
        self.hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (np.arange(0, self.hd, 2, dtype=np.float32) / self.hd))

    def norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg["rms_norm_eps"]) * w

    def rope(self, x, pos):  # x: (heads, T, hd)
        f = pos[:, None].astype(np.float32) * self.inv_freq[None, :]
        emb = np.concatenate([f, f], -1)
        cos, sin = np.cos(emb), np.sin(emb)
        h = self.hd // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def logits_last(self, ids: list[int]) -> np.ndarray:
        c, w = self.cfg, self.w
        T = len(ids)
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], self.hd
        pos = np.arange(T)
        x = w["model.embed_tokens.weight"][ids]
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
            q, k = self.rope(q, pos), self.rope(k, pos)
            rep = nh // nkv
            k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self.norm(x, w[p + "post_attention_layernorm.weight"])
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
        x = self.norm(x[-1:], w["model.norm.weight"])
        return (x @ w["lm_head.weight"].T)[0]


def document_text(path: Path) -> str:
    """One document as docs/demo-model.md describes: header with the file name as title."""
    title = re.sub(r"[_\-.]+", " ", path.stem).strip().lower()
    return f"<|doc|> title : {title} .\n{path.read_text().strip()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--doc", action="append", default=[])
    ap.add_argument("--ask", action="append", required=True)
    ap.add_argument("--max-new", type=int, default=40)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    md = Path(a.model_dir)
    tok = Tokenizer.from_file(str(md / "tokenizer.json"))
    gen = json.loads((md / "generation_config.json").read_text())
    stop = set(gen["eos_token_id"])
    model = Llama(md)
    docs = "\n".join(document_text(Path(d)) for d in a.doc)
    for q in a.ask:
        prompt = f"<|bos|><|system|> {docs} <|end|>\n<|user|> {q} <|end|>\n<|assistant|> "
        ids = tok.encode(prompt, add_special_tokens=False).ids
        unk = ids.count(tok.token_to_id("<|unk|>"))
        out: list[int] = []
        for _ in range(a.max_new):
            nxt = int(np.argmax(model.logits_last(ids + out)))
            if nxt in stop:
                break
            out.append(nxt)
        print(f"[{len(ids)} tokens, {unk} unk] {q}\n  -> {tok.decode(out)}")


if __name__ == "__main__":
    main()
