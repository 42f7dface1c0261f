#!/usr/bin/env python3
"""Generate tiny random-weight Hugging Face models plus reference outputs.

What it makes
-------------
Four model folders under ``--out`` (default ``tests/fixtures/models``):

* ``llama``   LlamaForCausalLM, GQA 4/2, llama3 rope scaling, untied,
              tokenizer post-processor adds BOS, chat template in
              ``chat_template.jinja``, classic-style config.json
              (top-level ``rope_theta`` / ``rope_scaling`` / ``torch_dtype``).
* ``qwen2``   Qwen2ForCausalLM, MHA 4/4, random q/k/v biases, tied
              embeddings, ChatML template inside tokenizer_config.json,
              config.json as transformers 5 writes it (``rope_parameters``).
* ``qwen3``   Qwen3ForCausalLM, GQA 8/2, head_dim 32 != hidden/heads,
              q_norm/k_norm, untied, saved as several safetensors shards
              with ``model.safetensors.index.json``; a Qwen3-like template
              (namespace, reversed loop, string methods, tojson, ...) in
              ``chat_template.jinja``; transformers 5 style config.json.
* ``mistral`` MistralForCausalLM, MQA 4/1, sliding_window 12, untied,
              [INST] template inside tokenizer_config.json that raises on
              non-alternating roles; classic-style config.json.

Every folder holds config.json, generation_config.json, the safetensors
weights, tokenizer.json, tokenizer_config.json, ppl.txt and reference.json.
reference.json holds full-vocabulary logits for one prompt, the mean NLL /
perplexity of ppl.txt (whole and first 40 tokens), a rendered chat prompt
and its token ids, 16 greedy tokens generated from that chat prompt with
the smallest top-1/top-2 logit margin seen while generating, extra chat
template cases, and (mistral only) the template's exception text.

All references are computed with the model and tokenizer RELOADED from the
folder as saved (the in-memory model is only used to check that the reload
reproduces the logits bit for bit).

The byte-level BPE tokenizers (590 learned entries + added tokens) are
trained here with the ``tokenizers`` library on an English corpus embedded in
this script. llama/mistral use a plain ByteLevel pre-tokenizer; qwen2/qwen3
use NFC + Split(Qwen regex) + ByteLevel(use_regex=False), because
transformers 5 loads qwen2/qwen3 tokenizers through its own Qwen2Tokenizer
class, which rebuilds exactly that pipeline from the vocab and merges. The
script asserts that transformers' tokenizer and the raw tokenizer.json agree
on a set of tricky strings (recorded as reference.json["tokenizer_cases"]).

Besides the keys asked for, reference.json records: seed, vocab_size,
special_token_ids, tokenizer_class (the class transformers picked),
tokenizer_cases, chat_cases (more template renderings: multi-turn, no
generation prompt, enable_thinking=False, tools), greedy.top2_margins and
greedy.eos_token_ids. Logit values are written with the shortest decimal that
round-trips to the same float32.

tools/check_fixtures_numpy.py re-derives the logits, perplexities and greedy
tokens with an independent float64 NumPy implementation (no torch needed).

How to run
----------
    python3 tools/make_fixtures.py --out tests/fixtures/models

Needs torch, transformers (>= 5), tokenizers, safetensors, jinja2, numpy.
Everything runs on the CPU in float32 with eager attention, seeded and
deterministic (no GPU is used even if present).

The committed fixtures were produced (on CPU) with Python 3.12.3, torch
2.11.0+cu130, transformers 5.17.0, tokenizers 0.23.2, safetensors 0.8.0,
numpy 2.5.2 and jinja2 3.1.6; reference.json records the torch and
transformers versions. ``--tokenizers-only`` writes just the tokenizer files
(and, if transformers is importable, checks them); it needs no torch.
"""

import argparse
import json
import math
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_texts import (  # noqa: E402
    LOGITS_TEXT,
    PPL_TEXT,
    CHAT_MESSAGES,
    LLAMA_TEMPLATE,
    QWEN2_TEMPLATE,
    QWEN3_TEMPLATE,
    MISTRAL_TEMPLATE,
    EXTRA_CHAT_CASES,
    MISTRAL_BAD_MESSAGES,
    build_corpus,
)

BPE_VOCAB = 590  # learned vocabulary (256 bytes + merges), before added tokens


# The pre-tokenizer split pattern of Qwen2/Qwen3 tokenizers. transformers 5 loads a
# "qwen2" checkpoint's tokenizer with its own Qwen2Tokenizer class, which rebuilds
# the pipeline as NFC + Split(this regex) + ByteLevel(use_regex=False) from the
# vocab/merges; our tokenizer.json uses exactly that pipeline so that the
# `tokenizers` library reading tokenizer.json and transformers always agree.
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_bpe(leading_specials=(), qwen_style=False):
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, trainers)

    tok = Tokenizer(models.BPE())
    if qwen_style:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB + len(leading_specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in leading_specials],
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    return tok


def make_tokenizer(name):
    """Returns (tokenizers.Tokenizer, dict of added token -> id)."""
    from tokenizers import AddedToken, processors

    def special(t):
        return AddedToken(t, special=True, normalized=False)

    if name == "mistral":
        # Specials first (ids 0..4) like real Mistral/Llama-2 vocabularies.
        tok = train_bpe(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif name == "llama":
        # Specials appended after the learned vocabulary, like Llama 3.
        tok = train_bpe()
        tok.add_special_tokens([special(t) for t in [
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]])
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=bos + " $A",
            pair=bos + " $A " + bos + " $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:  # qwen2 / qwen3
        tok = train_bpe(qwen_style=True)
        tok.add_special_tokens([special(t) for t in [
            "<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
        if name == "qwen3":
            # Like real Qwen3: <think>/</think> are added tokens but not "special"
            # (decode(skip_special_tokens=True) keeps them).
            tok.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t in ["<think>", "</think>"]])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    ids = {}
    for t in tok.get_added_tokens_decoder().values():
        ids[t.content] = tok.token_to_id(t.content)
    return tok, ids


def tokenizer_config(name, tok):
    added = {}
    for idx, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(idx)] = {
            "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
            "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special,
        }
    cfg = {"added_tokens_decoder": added}
    if name == "llama":
        cfg.update({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    elif name in ("qwen2", "qwen3"):
        cfg.update({"bos_token": None, "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>", "errors": "replace",
                    "split_special_tokens": False})
    elif name == "mistral":
        cfg.update({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                    "pad_token": None})
    if name == "qwen2":
        cfg["chat_template"] = QWEN2_TEMPLATE
    elif name == "mistral":
        cfg["chat_template"] = MISTRAL_TEMPLATE
    cfg.update({
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 512,
        "tokenizer_class": "Qwen2Tokenizer" if name.startswith("qwen") else "PreTrainedTokenizerFast",
    })
    return cfg


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------

SEEDS = {"llama": 1001, "qwen2": 2002, "qwen3": 3003, "mistral": 4004}


def build_config(name, vocab, ids):
    import transformers as tf
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=512, hidden_act="silu", initializer_range=0.2,
        attention_dropout=0.0, use_cache=True,
    )
    if name == "llama":
        return tf.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
            bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
    if name == "qwen2":
        return tf.Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    if name == "qwen3":
        return tf.Qwen3Config(
            **common, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=None, eos_token_id=ids["<|im_end|>"])
    if name == "mistral":
        return tf.MistralConfig(
            **common, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=12,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    raise ValueError(name)


GEN_EOS = {
    "llama": ["<|eot_id|>", "<|end_of_text|>"],
    "qwen2": ["<|im_end|>", "<|endoftext|>"],
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "mistral": ["</s>"],
}


def randomize_(model, seed):
    """Random RMSNorm weights (incl. q_norm/k_norm) and biases."""
    import torch
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def classic_config(path, name):
    """Rewrite config.json in the classic Hub style (rope_theta/rope_scaling/torch_dtype)."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    if name == "mistral":
        cfg.pop("layer_types", None)
    cfg = dict(sorted(cfg.items()))
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def f32_list(t):
    """float32 tensor -> nested list of Python floats whose repr round-trips in f32."""
    import numpy as np
    a = t.detach().to("cpu").float().numpy()
    return [float(str(np.float32(v))) for v in a.reshape(-1)] if a.ndim == 1 else \
        [f32_list(row) for row in t]


TOKENIZER_TEXTS = [
    LOGITS_TEXT,
    "In 2024, I'd say it's 3.14159 -- isn't it?\n\n  Indented   text\twith tabs",
    "H\u00e9llo w\u00f6rld caf\u00e9 na\u00efve \u2014 \u201cquotes\u201d \u6771\u4eac \U0001F642",
    "Cafe\u0301 (combining accent) and \ufb01 ligature",
    "I'LL DON'T we've THEY'RE",
    "   leading spaces and trailing   ",
    "line one\r\nline two\n\n\nline five",
    "<|im_start|>user\nhi<|im_end|> <s>[INST] x [/INST]</s> <|eot_id|><think>ok</think>",
    "",
]


def tokenizer_cases(tokenizer, raw):
    """Checks transformers' tokenizer against the raw `tokenizers` one; returns the cases."""
    cases = []
    for text in TOKENIZER_TEXTS:
        with_sp = tokenizer(text)["input_ids"]
        no_sp = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert with_sp == raw.encode(text).ids, (text, with_sp, raw.encode(text).ids)
        assert no_sp == raw.encode(text, add_special_tokens=False).ids, text
        dec = tokenizer.decode(no_sp)
        assert dec == raw.decode(no_sp, skip_special_tokens=False), (text, dec)
        dec_skip = tokenizer.decode(no_sp, skip_special_tokens=True)
        assert dec_skip == raw.decode(no_sp, skip_special_tokens=True), (text, dec_skip)
        cases.append({"text": text, "ids": with_sp, "ids_no_special": no_sp,
                      "decoded": dec, "decoded_skip_special": dec_skip})
    return cases


def bos_rule(ids, bos):
    ids = list(ids)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def chat_ids(tokenizer, messages, **kw):
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    assert list(out) == list(ids), (name_of(tokenizer), out, ids)
    return text, ids


def name_of(tokenizer):
    return getattr(tokenizer, "name_or_path", "?")


def write_tokenizer_files(d: str, name: str):
    """tokenizer.json, tokenizer_config.json and (llama, qwen3) chat_template.jinja into d."""
    tok, ids = make_tokenizer(name)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(name, tok), f, indent=2, ensure_ascii=False)
        f.write("\n")
    if name in ("llama", "qwen3"):
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write(LLAMA_TEMPLATE if name == "llama" else QWEN3_TEMPLATE)
    return tok, ids


def generate_fixture(name, out_dir, seed):
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)

    tok, ids = write_tokenizer_files(d, name)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    with open(os.path.join(d, "ppl.txt"), "w") as f:
        f.write(PPL_TEXT)

    # ---- model -----------------------------------------------------------
    config = build_config(name, vocab, ids)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model, seed)
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    save_kw = {"max_shard_size": "200KB"} if name == "qwen3" else {}
    model.save_pretrained(d, **save_kw)
    if name in ("llama", "mistral"):
        classic_config(os.path.join(d, "config.json"), name)
    # generation_config.json written by hand so that every key is explicit.
    gen_eos = [ids[t] for t in GEN_EOS[name]]
    gcfg = {}
    if config.bos_token_id is not None:
        gcfg["bos_token_id"] = config.bos_token_id
    gcfg["do_sample"] = False
    gcfg["eos_token_id"] = gen_eos if len(gen_eos) > 1 else gen_eos[0]
    gcfg["transformers_version"] = tf.__version__
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(gcfg, f, indent=2)
        f.write("\n")

    # ---- reload & verify ---------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(d)
    rmodel = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                  attn_implementation="eager")
    rmodel.eval()
    assert rmodel.config.vocab_size == vocab
    assert rmodel.generation_config.eos_token_id == gcfg["eos_token_id"]
    from tokenizers import Tokenizer
    tok_cases = tokenizer_cases(tokenizer, Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
    bos = rmodel.config.bos_token_id

    enc = tokenizer(LOGITS_TEXT)["input_ids"]
    logit_ids = bos_rule(enc, bos)
    with torch.no_grad():
        x = torch.tensor([logit_ids])
        a = model(x).logits[0]
        b = rmodel(x).logits[0]
    assert torch.equal(a, b), "%s: reloaded model differs (max %g)" % (name, (a - b).abs().max())
    del model
    assert b.dtype == torch.float32

    if name == "mistral":
        assert len(logit_ids) > rmodel.config.sliding_window + 4
        # sanity: the sliding window must actually matter for the last position
        cfg_full = tf.AutoConfig.from_pretrained(d)
        cfg_full.sliding_window = None
        full = AutoModelForCausalLM.from_pretrained(d, config=cfg_full, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
        with torch.no_grad():
            c = full(x).logits[0]
        w = rmodel.config.sliding_window
        # Convention check: query i sees key j iff 0 <= i - j < w, so rows 0..w-1 are
        # unaffected by the window and row w (which loses key 0) differs.
        assert torch.equal(c[:w], b[:w]), "mistral: window should not matter before position w"
        assert not torch.allclose(c[w], b[w]), "mistral: row w should lose key 0"
        del full

    ref = {
        "model_type": rmodel.config.model_type,
        "transformers_version": tf.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "vocab_size": vocab,
        "special_token_ids": ids,
        "tokenizer_class": type(tokenizer).__name__,
        "tokenizer_cases": tok_cases,
        "logits": {"text": LOGITS_TEXT, "input_ids": logit_ids, "values": f32_list(b)},
    }

    # ---- perplexity --------------------------------------------------------
    ppl_ids = bos_rule(tokenizer(PPL_TEXT)["input_ids"], bos)
    with torch.no_grad():
        loss = rmodel(torch.tensor([ppl_ids]), labels=torch.tensor([ppl_ids])).loss
        loss40 = rmodel(torch.tensor([ppl_ids[:40]]), labels=torch.tensor([ppl_ids[:40]])).loss
    ref["perplexity"] = {"file": "ppl.txt", "input_ids": ppl_ids,
                         "mean_nll": float(loss), "perplexity": math.exp(float(loss))}
    ref["perplexity_max_tokens"] = {"max_tokens": 40, "mean_nll": float(loss40),
                                    "perplexity": math.exp(float(loss40))}

    # ---- chat ---------------------------------------------------------------
    text, cids = chat_ids(tokenizer, CHAT_MESSAGES, add_generation_prompt=True)
    ref["chat"] = {"messages": CHAT_MESSAGES, "add_generation_prompt": True,
                   "text": text, "ids": cids}
    cases = []
    for case in EXTRA_CHAT_CASES[name]:
        kw = {k: v for k, v in case.items() if k != "messages"}
        t, i = chat_ids(tokenizer, case["messages"], **kw)
        cases.append(dict(case, text=t, ids=i))
    ref["chat_cases"] = cases
    if name == "mistral":
        try:
            tokenizer.apply_chat_template(MISTRAL_BAD_MESSAGES, tokenize=False,
                                          add_generation_prompt=True)
            raise AssertionError("mistral template did not raise")
        except Exception as e:  # jinja2.exceptions.TemplateError
            if isinstance(e, AssertionError):
                raise
            ref["chat_error"] = {"messages": MISTRAL_BAD_MESSAGES, "message": str(e),
                                 "exception_type": type(e).__name__}

    # ---- greedy -------------------------------------------------------------
    prompt = torch.tensor([cids])
    with torch.no_grad():
        gen = rmodel.generate(prompt, attention_mask=torch.ones_like(prompt),
                              do_sample=False, max_new_tokens=16)
    if hasattr(gen, "sequences"):
        gen = gen.sequences
    new = gen[0, len(cids):].tolist()
    margins = []
    with torch.no_grad():
        for k in range(len(new)):
            seq = torch.tensor([cids + new[:k]])
            last = rmodel(seq).logits[0, -1]
            top = torch.topk(last, 2)
            margin = float(top.values[0] - top.values[1])
            if int(top.indices[0]) != new[k]:
                # cached (generate) and uncached forward disagree: only acceptable
                # for a near-tie, which makes the caller pick another seed.
                assert margin < 1e-3, (name, k, top, new)
                margin = 0.0
            margins.append(margin)
    ref["greedy"] = {"prompt_ids": cids, "max_new_tokens": 16, "new_tokens": new,
                     "eos_token_ids": gen_eos, "min_top2_margin": min(margins),
                     "top2_margins": margins}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, ensure_ascii=False)
        f.write("\n")
    return ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/models")
    ap.add_argument("--only", nargs="*", default=None, help="subset of models")
    ap.add_argument("--tokenizers-only", action="store_true",
                    help="only write tokenizer files (no torch needed); for checking")
    args = ap.parse_args()

    names = args.only or ["llama", "qwen2", "qwen3", "mistral"]
    os.makedirs(args.out, exist_ok=True)
    if args.tokenizers_only:
        for name in names:
            d = os.path.join(args.out, name)
            os.makedirs(d, exist_ok=True)
            tok, ids = write_tokenizer_files(d, name)
            print(name, tok.get_vocab_size(), ids)
            try:
                from transformers import AutoTokenizer
            except ImportError:
                continue
            from tokenizers import Tokenizer
            t = AutoTokenizer.from_pretrained(d)
            tokenizer_cases(t, Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
            for case in [{"messages": CHAT_MESSAGES, "add_generation_prompt": True}] + \
                    EXTRA_CHAT_CASES[name]:
                kw = {k: v for k, v in case.items() if k != "messages"}
                print("  ", repr(chat_ids(t, case["messages"], **kw)[0]))
        return

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only
    import torch
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    for name in names:
        seed = SEEDS[name]
        for attempt in range(20):
            ref = generate_fixture(name, args.out, seed)
            m = ref["greedy"]["min_top2_margin"]
            print("%s seed=%d vocab=%d min_top2_margin=%.6g new=%s" % (
                name, seed, ref["vocab_size"], m, ref["greedy"]["new_tokens"]), flush=True)
            if m >= 1e-3:
                break
            seed += 1
        else:
            sys.exit("%s: no seed with a clear greedy margin" % name)


if __name__ == "__main__":
    main()
