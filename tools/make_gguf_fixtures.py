#!/usr/bin/env python3
"""GGUF fixtures from the tiny Hugging Face fixtures, and llama.cpp's outputs for them.

What it makes (under ``--out``, default ``tests/fixtures/gguf``)
-----------------------------------------------------------------
* ``{llama,mistral,qwen2,qwen3}-f16.gguf``: the four tiny HF fixtures of
  tests/fixtures/models written as GGUF the way llama.cpp's converter writes
  them: its architecture names (Mistral is ``llama``, as the converter files
  it), its metadata keys and tensor names, the q/k rows of llama-architecture
  models permuted to the interleaved rotary layout, Llama 3's RoPE rule as a
  ``rope_freqs.weight`` tensor, 1-D tensors in F32, the byte-level BPE
  vocabulary as ``tokenizer.ggml.*`` (model ``gpt2``, pre-tokenizer ``gpt-2``
  or ``qwen2``), the chat template in ``tokenizer.chat_template``.
* ``qwen2-bf16.gguf``: the qwen2 fixture in BF16.
* ``mistral-spm-f16.gguf``: the mistral fixture's weights with a SentencePiece
  vocabulary (``tokenizer.ggml.model = llama``, as Llama 2's and Mistral 7B's
  files have it): ``<unk>``, ``<s>``, ``</s>``, the 256 byte pieces, single
  characters, and pieces grown from the fixture's BPE merges (spaces as ``▁``),
  each with a score (later merges lower). ``--only spm`` makes just this file
  and adds its entry to an existing ``reference.json``.
* ``mistral-tekken-f16.gguf``: the mistral fixture with the pre-tokenizer name
  ``tekken`` (Mistral Nemo's and Mistral Small 3's split: words by case, single
  digits); ``--only tekken`` as ``--only spm``.
* ``llama256-{Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0}.gguf``: a llama-architecture model
  whose rows are 256 wide (k-quants quantize blocks of 256, so the 64-wide
  fixtures would fall back to other types), random weights from a seed, the
  llama fixture's tokenizer; written in F16 and quantized by llama.cpp itself
  (``llama_model_quantize``), so each file holds the type mix llama.cpp
  chooses for that name.
* ``reference.json``: for every file, llama.cpp's tokenization of test strings,
  its logits for a prompt (its last ``LOGIT_ROWS`` positions, full
  vocabulary), its greedy tokens from a chat prompt with each step's top-1/top-2
  margin, and for the F16 files the largest difference of llama.cpp's logits
  from transformers' (tests/fixtures/models/*/reference.json).

How to run
----------
    tools/gguf-reference-env.sh     # a venv with numpy, gguf, safetensors and
                                    # llama-cpp-python built from source
    ~/.cache/folio-gguf-venv/bin/python tools/make_gguf_fixtures.py

Everything is seeded; llama.cpp runs on the CPU.
"""

import argparse
import ctypes
import json
import math
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
from safetensors.numpy import load_file

import check_fixtures_numpy

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests/fixtures/models"
LOGIT_ROWS = 8
GGML_TYPE_F32 = 0
GREEDY_TOKENS = 16
SEED = 4646
QUANTS = {
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}
# The GGUF architecture each HF model_type is written as (llama.cpp files Mistral as llama).
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PRE = {"llama": "gpt-2", "mistral": "gpt-2", "qwen2": "qwen2", "qwen3": "qwen2"}
TOKEN_CASES = [
    "The old captain carried a basket of apples to the market.",
    "  two  spaces,\nnew lines\n\n and tabs\there 12345 67!",
    "<|im_start|>user\nHi<|im_end|>",
]
# SentencePiece cases: the space in front, runs of spaces, characters only bytes cover (byte
# fallback), control tokens with text after them (a space in front again).
SPM_CASES = [
    "The old captain carried a basket of apples to the market.",
    "  two  spaces,\nnew lines\n\n and tabs\there 12345 67!",
    "caf\u00e9 na\u00efve \u65e5\u672c \U0001f642 end",
    "<s>[INST] Hi there [/INST] Hello</s>",
    "the theater then",
]
SPM_FILE = "mistral-spm-f16.gguf"
TEKKEN_FILE = "mistral-tekken-f16.gguf"
# Tekken's split: words by case (CamelCase, ACRONYMWords), single digits, "/" kept after
# punctuation.
TEKKEN_CASES = TOKEN_CASES[:2] + [
    "HelloWorld and CamelCaseWords, HTTPServer 2024/11/30 path/to/file.txt",
    "<s>[INST] ALL CAPS here [/INST]</s>",
]
SPACE_MARK = "\u2581"
SPM_CHARS = SPACE_MARK + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()[]/<>"


def byte_level_text(token: str):
    """A byte-level BPE token's text (GPT-2's byte-to-character map undone), or None when its
    bytes are not whole UTF-8."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    try:
        return bytes(chars[c] for c in token).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return None


def spm_vocab(folder: Path, n: int):
    """A SentencePiece vocabulary of ``n`` pieces: tokens, scores, types."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = set()
    for c in SPM_CHARS:
        tokens.append(c)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1e4 - len(tokens))
        pieces.add(c)
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    for m in merges:
        a, b = m.split(" ") if isinstance(m, str) else m
        left, right = byte_level_text(a), byte_level_text(b)
        if left is None or right is None:
            continue
        left, right = left.replace(" ", SPACE_MARK), right.replace(" ", SPACE_MARK)
        piece = left + right
        if left in pieces and right in pieces and piece not in pieces and len(tokens) < n:
            tokens.append(piece)
            types.append(gguf.TokenType.NORMAL)
            scores.append(-float(len(tokens)))
            pieces.add(piece)
    while len(tokens) < n:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(gguf.TokenType.UNUSED)
        scores.append(-1e9)
    return tokens, scores, types


def hf_weights(folder: Path) -> dict:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update({k: v.astype(np.float32) for k, v in load_file(str(folder / f)).items()})
    return out


def rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def llama3_factors(cfg: dict) -> np.ndarray:
    """Llama 3's per-frequency divisors, as the converter writes them into rope_freqs.weight."""
    s = cfg["rope_scaling"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope_theta(cfg) ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    old = s["original_max_position_embeddings"]
    low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = (old / wl - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half rows of each head -> llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def vocab(folder: Path, cfg: dict):
    tok = json.loads((folder / "tokenizer.json").read_text())
    ids = dict(tok["model"]["vocab"])
    types = {i: gguf.TokenType.NORMAL for i in ids.values()}
    for t in tok["added_tokens"]:
        ids[t["content"]] = t["id"]
        types[t["id"]] = gguf.TokenType.CONTROL if t["special"] else gguf.TokenType.USER_DEFINED
    by_id = {i: s for s, i in ids.items()}
    tokens, token_types = [], []
    for i in range(cfg["vocab_size"]):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        token_types.append(types.get(i, gguf.TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    adds_bos = "TemplateProcessing" in json.dumps(tok.get("post_processor"))
    return tokens, token_types, merges, adds_bos


def chat_template(folder: Path):
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    return json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")


def write_gguf(out: Path, model_type: str, cfg: dict, weights: dict, tok_folder: Path, dtype: str, spm=False,
               pre=None):
    arch = ARCH[model_type]
    w = gguf.GGUFWriter(str(out), arch)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    w.add_name(f"folio-{out.stem}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_rope_dimension_count(hd)
    if cfg.get("head_dim"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.MOSTLY_BF16)
    if spm:
        tokens, scores, token_types = spm_vocab(tok_folder, cfg["vocab_size"])
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_add_space_prefix(True)
        adds_bos = True
    else:
        tokens, token_types, merges, adds_bos = vocab(tok_folder, cfg)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or PRE[model_type])
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(adds_bos)
    if (template := chat_template(tok_folder)) is not None:
        w.add_chat_template(template)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(cfg))
    for name, t in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, kv_heads)
        if t.ndim == 1:
            w.add_tensor(gguf_name(name), t.astype(np.float32))
        elif dtype == "f16":
            w.add_tensor(gguf_name(name), t.astype(np.float16))
        else:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.BF16)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def wide_model() -> tuple[dict, dict]:
    """The 256-wide llama-architecture model: config and seeded random weights."""
    cfg = json.loads((HF / "llama/config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, max_position_embeddings=4096)
    cfg.pop("head_dim", None)
    rng = np.random.default_rng(SEED)
    h, inter, hd = 256, 512, 64
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (4 * hd, h), f"{p}.self_attn.k_proj.weight": (2 * hd, h),
            f"{p}.self_attn.v_proj.weight": (2 * hd, h), f"{p}.self_attn.o_proj.weight": (h, 4 * hd),
            f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        })
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
    return cfg, weights


def quantize(src: Path, dst: Path, ftype: int):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {dst.name}: {rc}")


def rounded(weights: dict, dtype: str) -> dict:
    """The weights as a file of `dtype` holds them (matrices rounded, vectors in f32), in f64."""
    out = {}
    for name, t in weights.items():
        if t.ndim == 2 and dtype == "f16":
            t = t.astype(np.float16)
        elif t.ndim == 2:
            t = gguf.quants.dequantize(gguf.quants.quantize(t, gguf.GGMLQuantizationType.BF16),
                                       gguf.GGMLQuantizationType.BF16)
        out[name] = t.astype(np.float64)
    return out


def numpy_logits(weights: dict, cfg: dict, dtype: str, ids: list) -> np.ndarray:
    """The float64 NumPy decoder over the file's rounded weights; no sliding window, as the
    llama architecture has none in GGUF."""
    cfg = dict(cfg, sliding_window=None)
    return check_fixtures_numpy.forward(None, ids, rounded(weights, dtype), cfg)


def hf_name(gguf_tensor: str) -> str:
    back = {v: k for k, v in GGUF_NAMES.items()}
    special = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    if gguf_tensor in special:
        return special[gguf_tensor]
    _, layer, module, kind = gguf_tensor.split(".")
    return f"model.layers.{layer}.{back[module]}.{kind}"


def dequantized_logits(path: Path, cfg: dict, ids: list) -> np.ndarray:
    """The float64 decoder over a quantized file's weights dequantized (gguf-py's ggml
    dequantizers): the products without the activations' 8-bit rounding both llama.cpp and
    Folio apply."""
    weights = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "rope_freqs.weight":
            continue
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(x) for x in reversed(t.shape)])
        name = hf_name(t.name)
        heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        if "q_proj" in name or "k_proj" in name:  # back to rotate-half rows
            a = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        weights[name] = a
    return check_fixtures_numpy.forward(None, ids, weights, dict(cfg, sliding_window=None))


def run_llama(path: Path, logits_ids: list, chat_ids: list, cases=TOKEN_CASES) -> dict:
    # One token a batch: this llama.cpp build crashes multiplying quantized matrices by batches
    # of tokens on this CPU; a batch of one takes its matrix-vector path, the same arithmetic.
    # K/V kept in f32 (llama.cpp's default is f16), so its logits differ from the float64
    # reference by the weights' rounding and its own arithmetic only.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=1, logits_all=True, verbose=False,
                          n_threads=2, seed=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in cases]
    llm.reset()
    llm.eval(logits_ids)
    scores = np.array(llm.scores[: len(logits_ids)], dtype=np.float32)
    llm.reset()
    llm.eval(chat_ids)
    greedy, margins = [], []
    for _ in range(GREEDY_TOKENS):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.argsort(row)[::-1][:2]
        greedy.append(int(top[0]))
        margins.append(float(row[top[0]] - row[top[1]]))
        llm.eval([int(top[0])])
    return {"tokens": cases, "logits_all": scores, "greedy": greedy, "greedy_margins": margins,
            "n_vocab": llm.n_vocab()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/gguf")
    ap.add_argument("--only", choices=["spm", "tekken"], help="make only this fixture, its entry added to reference.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        one_fixture(args.out, args.only)
        return
    tmp = args.out / "tmp"
    tmp.mkdir(exist_ok=True)
    files, exact = {}, {}
    for model_type in ["llama", "mistral", "qwen2", "qwen3"]:
        folder = HF / model_type
        cfg = json.loads((folder / "config.json").read_text())
        weights = hf_weights(folder)
        ids = json.loads((folder / "reference.json").read_text())["logits"]["input_ids"]
        for dtype in ["f16", "bf16"] if model_type == "qwen2" else ["f16"]:
            write_gguf(args.out / f"{model_type}-{dtype}.gguf", model_type, cfg, weights, folder, dtype)
            files[f"{model_type}-{dtype}.gguf"] = model_type
            exact[f"{model_type}-{dtype}.gguf"] = numpy_logits(weights, cfg, dtype, ids)
    cfg, weights = wide_model()
    wide_f16 = tmp / "llama256-F16.gguf"
    write_gguf(wide_f16, "llama", cfg, weights, HF / "llama", "f16")
    wide_ids = json.loads((HF / "llama/reference.json").read_text())["logits"]["input_ids"]
    wide_exact = numpy_logits(weights, cfg, "f16", wide_ids)
    for name, ftype in QUANTS.items():
        quantize(wide_f16, args.out / f"llama256-{name}.gguf", ftype)
        files[f"llama256-{name}.gguf"] = "llama"
    files["tmp/llama256-F16.gguf"] = "llama"
    wide_params = sum(t.size for t in weights.values())

    reference = {"llama_cpp_python": llama_cpp.__version__, "logit_rows": LOGIT_ROWS, "files": {}}
    for file, model_type in files.items():
        hf_ref = json.loads((HF / model_type / "reference.json").read_text())
        logits_ids, chat_ids = hf_ref["logits"]["input_ids"], hf_ref["greedy"]["prompt_ids"]
        out = run_llama(args.out / file, logits_ids, chat_ids)
        entry = {
            "model_type": model_type,
            "tokens": out["tokens"],
            "logits": {"input_ids": logits_ids,
                       "last_rows": [[float(f"{x:.7g}") for x in row] for row in out["logits_all"][-LOGIT_ROWS:]]},
            "greedy": {"prompt_ids": chat_ids, "new_tokens": out["greedy"],
                       "top2_margins": [round(m, 5) for m in out["greedy_margins"]]},
        }
        if file in exact:
            # The file's own weights through the float64 decoder: what F16/BF16 must match.
            entry["logits"]["numpy_last_rows"] = [[float(f"{x:.7g}") for x in row] for row in exact[file][-LOGIT_ROWS:]]
            entry["llama_cpp_max_abs_vs_numpy"] = float(np.abs(out["logits_all"] - exact[file]).max())
            hf_logits = np.array(hf_ref["logits"]["values"], dtype=np.float32)
            entry["llama_cpp_max_abs_vs_transformers_f32"] = float(np.abs(out["logits_all"] - hf_logits).max())
        if "llama256" in file and not file.startswith("tmp"):
            deq = dequantized_logits(args.out / file, cfg, logits_ids)
            entry["logits"]["dequantized_last_rows"] = [[float(f"{x:.7g}") for x in row] for row in deq[-LOGIT_ROWS:]]
            entry["llama_cpp_max_abs_vs_dequantized"] = float(np.abs(out["logits_all"] - deq).max())
        if "llama256" in file:
            entry["llama_cpp_max_abs_vs_numpy_f16"] = float(np.abs(out["logits_all"] - wide_exact).max())
        if "llama256" in file:
            entry["file_bits_per_weight"] = round(8 * (args.out / file).stat().st_size / wide_params, 3)
        reference["files"][file] = entry
        vs = entry.get("llama_cpp_max_abs_vs_numpy", entry.get("llama_cpp_max_abs_vs_numpy_f16"))
        print(f"{file}: greedy {out['greedy'][:6]}... min margin {min(out['greedy_margins']):.4f}, "
              f"llama.cpp vs numpy {vs:.2e} (largest logit {np.abs(out['logits_all']).max():.2f})")
    f16_rows = np.array(reference["files"].pop("tmp/llama256-F16.gguf")["logits"]["last_rows"])
    for file, entry in reference["files"].items():
        if file.startswith("llama256"):
            entry["max_abs_vs_f16"] = float(np.abs(np.array(entry["logits"]["last_rows"]) - f16_rows).max())
    (args.out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


def one_fixture(out: Path, which: str):
    """The SentencePiece or the tekken fixture and its reference entry, beside the existing ones."""
    folder = HF / "mistral"
    cfg = json.loads((folder / "config.json").read_text())
    weights = hf_weights(folder)
    hf_ref = json.loads((folder / "reference.json").read_text())
    ids, chat_ids = hf_ref["logits"]["input_ids"], hf_ref["greedy"]["prompt_ids"]
    if which == "spm":
        file, cases = SPM_FILE, SPM_CASES
        write_gguf(out / file, "mistral", cfg, weights, folder, "f16", spm=True)
    else:
        file, cases = TEKKEN_FILE, TEKKEN_CASES
        write_gguf(out / file, "mistral", cfg, weights, folder, "f16", pre="tekken")
    run = run_llama(out / file, ids, chat_ids, cases)
    exact = numpy_logits(weights, cfg, "f16", ids)
    rows = lambda a: [[float(f"{x:.7g}") for x in row] for row in a[-LOGIT_ROWS:]]
    reference = json.loads((out / "reference.json").read_text())
    reference["files"][file] = {
        "model_type": "mistral",
        "tokens": run["tokens"],
        "logits": {"input_ids": ids, "last_rows": rows(run["logits_all"]), "numpy_last_rows": rows(exact)},
        "greedy": {"prompt_ids": chat_ids, "new_tokens": run["greedy"],
                   "top2_margins": [round(m, 5) for m in run["greedy_margins"]]},
        "llama_cpp_max_abs_vs_numpy": float(np.abs(run["logits_all"] - exact).max()),
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    for case in run["tokens"]:
        print(f"{file}: {case['text']!r} -> {case['ids']}")


if __name__ == "__main__":
    main()
