#!/usr/bin/env python3
"""Train Folio's demo model: a 3.5M-parameter Llama that retrieves facts from long documents.

Stage 1 (on the GPU machine, repo root; 6.3 minutes of training on one H200, plus ~1 of eval):

    python3 tools/train_demo.py --out /tmp/demo --seed 1234 --steps 14000

Dense eval at 1M tokens of an exported folder (~20 s a prompt on an H200):

    python3 tools/train_demo.py --out assets/models/demo --eval-only --eval-tasks none --eval-1m 2

Quick check of the whole pipeline (~1 minute): add `--smoke`.

`--model yardstick` trains issue #49's deeper model instead (yardstick_tasks.SHAPE: 24 layers,
7 query heads per K/V head) on the RULER-style suite's data (recipe yard1), and ends by scoring
each task on held-out sequences (docs/yardstick.md, with the first runs' figures):

    python3 tools/train_demo.py --model yardstick --out /tmp/y1 --seed 1234 --steps 3600 --eval-tasks none

The defaults are the first of the shipped model's three stages (recipe run1); the other two
fine-tune it (`--init`) on longer sequences (`--curriculum`) and on recipe run5's data:
tools/train_demo_shipped.sh runs all three. `--recipe run3` is a documented negative result
(5-digit values only, no digits in the filler, fact-to-question PoSE skips):

    python3 tools/train_demo.py --out /tmp/run3 --recipe run3 --seed 1234 --steps 14000 --eval-512k 2

What it makes, in --out (Hugging Face format, loadable by transformers and by Folio's llama path):
    config.json, model.safetensors (bf16), generation_config.json, tokenizer.json,
    tokenizer_config.json, chat_template.jinja, eval_spec.json, training_log.json

How (see docs/demo-model.md for the full story and the measured figures):
  * Language: tools/demo_grammar.py -- a word-level vocabulary (~900 tokens), a filler grammar
    (41 sentence templates, records with numbers), keys "{adj} {noun}", facts
    "the {relation} of {key} is {value} .". Prompts follow eval_spec.json exactly
    (tools/demo_prompts.py, which reads only eval_spec.json, makes the eval prompts).
  * Tasks: single needle (pass key), multi-key/value recall with confusable keys, variable
    tracking (0-2 hop chains), facts spread over several documents (two facts asked at once);
    1-3 question turns per sequence; documents in the system message (70%) or in the user message.
  * The answer repeats the fact's wording before the value ("the secret code of amber falcon is
    4 8 1 5 2 ."), so the value is a pure copy of what followed the same words in the documents.
  * Loss only on assistant answers (and their <|end|>).
  * Curriculum: sequence length 256 -> 512 -> 1k -> 2k -> 4k over the run, constant tokens/step.
  * PoSE-style position skips: 80% of sequences are cut into 2-3 chunks with random gaps in the
    position ids so a 4k window spans positions up to 1.18M (log-uniform max position; recipe
    run3 instead puts one log-uniform skip between the asked fact and the question);
    rope theta 2e6; max_position_embeddings 1179648 (= 2^20 + 2^17).
  * Seeded: data of step s comes from numpy's default_rng([seed, s]); torch.manual_seed(seed).
  * Recipes (demo_grammar.RECIPES) switch the value length, the {num} filler slot and the PoSE
    scheme; the default, run1, is the shipped model's first stage.
  * Ends with a dense (sdpa) greedy eval of the exported folder at 2k..128k x depths 0..1, in
    two modes from one prefill: "generated" (the model writes the whole answer) and "prefilled"
    (the prompt continues with the answer prefix, "... <|assistant|> the secret code of amber
    falcon is", and the model writes only the value).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_grammar as G  # noqa: E402
import yardstick_tasks as Y  # noqa: E402
from demo_prompts import make_prompt, value_match  # noqa: E402

from demo_data import MAX_POS, ROPE_THETA, CURRICULUM, TrainData, distance_histogram, length_at, parse_curriculum  # noqa: E402

# ======================================================================================
# Export
# ======================================================================================
def write_static_files(out: Path, vocab: list[str], spec: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(G.tokenizer_json(vocab), ensure_ascii=False, indent=1))
    (out / "chat_template.jinja").write_text(G.CHAT_TEMPLATE)
    (out / "eval_spec.json").write_text(json.dumps(spec, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": G.BOS, "eos_token": G.END, "unk_token": G.UNK, "pad_token": G.PAD,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POS,
    }, indent=1))
    ids = {t: vocab.index(t) for t in G.SPECIALS}
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids[G.BOS], "eos_token_id": [ids[G.END], ids[G.EOS]], "pad_token_id": ids[G.PAD],
        "do_sample": False, "max_new_tokens": 64,
    }, indent=1))


# The demo model's shape; the yardstick's is yardstick_tasks.SHAPE.
DEMO_SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 768}
# Per model: its shape, vocabulary, eval spec and default recipe.
MODELS = {
    "demo": (DEMO_SHAPE, G.vocabulary, G.eval_spec, G.DEFAULT_RECIPE),
    "yardstick": (Y.SHAPE, Y.vocabulary, Y.eval_spec, "yard1"),
}


def llama_config(vocab: list[str], shape: dict = DEMO_SHAPE):
    from transformers import LlamaConfig

    ids = {t: vocab.index(t) for t in G.SPECIALS}
    return LlamaConfig(
        vocab_size=len(vocab), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=ids[G.BOS], eos_token_id=[ids[G.END], ids[G.EOS]], pad_token_id=ids[G.PAD],
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
    )


def export(model, out: Path, vocab: list[str], spec: dict) -> None:
    import torch

    write_static_files(out, vocab, spec)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=sd, safe_serialization=True)
    # save_pretrained may write its own generation_config.json; ours (two eos ids, greedy) wins
    write_static_files(out, vocab, spec)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", ROPE_THETA)  # classic top-level key for older readers
    cfg["max_position_embeddings"] = MAX_POS
    for k in ("dtype", "torch_dtype"):
        if k in cfg:
            cfg[k] = "bfloat16"
    cfg.setdefault("dtype", "bfloat16")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ======================================================================================
# Eval (dense, PyTorch sdpa), from the exported folder
# ======================================================================================
def evaluate(out: Path, lengths, depths, samples, tasks, seed, time_limit, log):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaForCausalLM

    from demo_prompts import load

    spec, tok = load(out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    stop = {tok.token_to_id(G.END), tok.token_to_id(G.EOS)}
    log(f"eval model: {model.dtype}, rotary inv_freq {model.model.rotary_emb.inv_freq.dtype}, "
        f"rope {model.config.rope_parameters}")
    cache: dict[str, int] = {}

    def count(s: str) -> int:
        # one token per whitespace-separated word or punctuation mark, one per digit; special
        # tokens and text with glued punctuation go through the tokenizer
        if "<|" in s or not s.replace(" ", "").replace(".", "").replace(",", "").replace(":", "").isalnum():
            c = cache.get(s)
            if c is None:
                c = cache[s] = len(tok.encode(s, add_special_tokens=False).ids)
            return c
        return sum(len(w) if w.isdigit() else 1 for w in s.split())

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    @torch.no_grad()
    def step(x: list[int], past):
        with sdpa_kernel(backends):
            o = model(input_ids=torch.tensor([x], device="cuda"), past_key_values=past, use_cache=True)
        return o.past_key_values, o.logits[0].argmax(-1).tolist()

    @torch.no_grad()
    def greedy_from(past, nxt: int, max_new: int) -> list[int]:
        gen = []
        while True:
            gen.append(nxt)
            if nxt in stop or len(gen) >= max_new:
                return gen
            past, p = step([nxt], past)
            nxt = p[-1]

    @torch.no_grad()
    def score(ids: list[int], ans: list[int], n_pre: int):
        """Both modes from one prefill of the prompt (KV cache):
        generated: greedy decoding after the generation prompt must give `ans` then a stop token;
        prefilled: the prompt continues with ans[:n_pre] (up to and including the answer prefix),
        and greedy decoding must give the rest of `ans` then a stop token.
        The answer is teacher-forced through the cache in one chunk (greedy decoding produces
        exactly the expected tokens iff every argmax along the forced answer matches); where a
        mode fails, the cache is cropped back and that mode is decoded greedily.
        Returns (generated ids, prefilled ids after the forced part), stop token included."""
        with sdpa_kernel(backends):
            o = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True, logits_to_keep=1)
        past, first = o.past_key_values, int(o.logits[0, -1].argmax())
        past, p = step(ans, past)
        pred = [first] + p  # pred[i] follows ans[:i]
        n = len(ans)
        full = ans + [pred[n]] if pred[n] in stop else None
        gen = full if (full and pred[:n] == ans) else None
        pre = full[n_pre:] if (full and pred[n_pre:n] == ans[n_pre:]) else None
        if pre is None:
            past = crop(past, ids + ans[:n_pre])
            pre = greedy_from(past, pred[n_pre], n - n_pre + 4)
        if gen is None:
            past = crop(past, ids)
            gen = greedy_from(past, first, n + 4)
        return gen, pre

    @torch.no_grad()
    def crop(past, keep: list[int]):
        """The cache cut back to the tokens `keep` (a prefix of what it holds)."""
        if hasattr(past, "crop"):
            drop = past.get_seq_length() - len(keep)
            if drop > 0:
                past.crop(-drop)  # a negative length removes that many tokens from the end
            return past
        with sdpa_kernel(backends):  # no crop in this transformers: prefill again
            return model(input_ids=torch.tensor([keep], device="cuda"), use_cache=True, logits_to_keep=1).past_key_values

    def sub_at(seq: list[int], part: list[int]) -> int:
        """End index of the last occurrence of `part` in `seq`."""
        for i in range(len(seq) - len(part), -1, -1):
            if seq[i:i + len(part)] == part:
                return i + len(part)
        raise ValueError("answer prefix not in the answer")

    t0 = time.time()
    results = []
    for task, tl, tsamples in tasks:
        for L in tl if tl else lengths:
            for d in depths:
                for s in range(tsamples or samples):
                    if time.time() - t0 > time_limit:
                        log(f"eval time limit reached; skipping the rest")
                        return results
                    rng = random.Random(f"{seed}/{task}/{L}/{d}/{s}")
                    role = "user" if (task == "needle" and s % 5 == 4) else None  # some user-role prompts too
                    p = make_prompt(spec, count, task, L, d, rng, role)
                    ids = tok.encode(p["prompt"], add_special_tokens=False).ids
                    assert L - 64 <= len(ids) <= L, (L, len(ids))
                    ans = tok.encode(p["answer"], add_special_tokens=False).ids
                    n_pre = sub_at(ans, tok.encode(p["answer_prefix"], add_special_tokens=False).ids)
                    t1 = time.time()
                    g, gp = score(ids, ans, n_pre)
                    body = [t for t in g if t not in stop]
                    text = tok.decode(body, skip_special_tokens=True)
                    body_p = ans[:n_pre] + [t for t in gp if t not in stop]
                    text_p = tok.decode(body_p, skip_special_tokens=True)
                    r = {
                        "task": task, "length": L, "tokens": len(ids), "depth": d, "sample": s,
                        "documents_role": role or "system",
                        "value_match": value_match(text, p["answer_prefix"], p["value"]),
                        "exact_match": body == ans and len(g) > len(body),
                        "output": text,
                        "prefilled_value_match": value_match(text_p, p["answer_prefix"], p["value"]),
                        "prefilled_exact_match": body_p == ans and gp[-1] in stop,
                        "prefilled_output": tok.decode(body_p[n_pre:], skip_special_tokens=True),
                        "prefilled_tokens": len(ids) + n_pre,
                        "expected": p["answer"], "seconds": round(time.time() - t1, 3),
                    }
                    results.append(r)
                    if L >= 500_000:
                        log(f"  {task} L={L} d={d} s={s}: generated {r['value_match']} prefilled "
                            f"{r['prefilled_value_match']} ({r['seconds']}s) out {r['output'][-40:]!r}")
            acc = [r for r in results if r["task"] == task and r["length"] == L]
            g_ok = sum(r["value_match"] for r in acc)
            p_ok = sum(r["prefilled_value_match"] for r in acc)
            log(f"eval {task} L={L}: value_match generated {g_ok}/{len(acc)}, prefilled {p_ok}/{len(acc)}  "
                f"({time.time() - t0:.0f}s)")
    return results


def table(results, task="needle", key="value_match"):
    lengths = sorted({r["length"] for r in results if r["task"] == task})
    depths = sorted({r["depth"] for r in results if r["task"] == task})
    rows = {}
    for L in lengths:
        row = {}
        for d in depths:
            rs = [r[key] for r in results if r["task"] == task and r["length"] == L and r["depth"] == d and key in r]
            row[str(d)] = (sum(rs) / len(rs)) if rs else None
        rows[str(L)] = row
    return rows


# ======================================================================================
# Training
# ======================================================================================
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model", choices=sorted(MODELS), default="demo",
                    help="demo: the bundled 4-layer model; yardstick: the 24-layer model of the RULER-style suite "
                    "(docs/yardstick.md)")
    ap.add_argument("--shape", type=parse_shape, default={},
                    help="change the model's shape for an ablation, e.g. layers=4,kv_heads=2 (keys of "
                    "yardstick_tasks.SHAPE; hidden follows heads x head_dim unless given)")
    ap.add_argument("--residual-init", action="store_true",
                    help="initialise o_proj and down_proj at std initializer_range / sqrt(2 x layers) (GPT-2's "
                    "scaled initialisation for deep residual stacks)")
    ap.add_argument("--recipe", choices=sorted({**G.RECIPES, **Y.RECIPES}),
                    help="data recipe (demo_grammar.RECIPES, yardstick_tasks.RECIPES); the default is the model's "
                    "first stage")
    ap.add_argument("--task-eval-lengths", default="2048,8192",
                    help="held-out sequences per task scored by exact match of the whole answer (teacher forced)")
    ap.add_argument("--task-eval-samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=14000)
    ap.add_argument("--curriculum", type=parse_curriculum, default=CURRICULUM,
                    help="sequence length:share of the steps, e.g. 4096:1 (default: the run-1 curriculum)")
    ap.add_argument("--init", help="start from the weights of this exported model folder (fine-tuning); "
                    "its vocabulary and shape must be this tool's")
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 2))
    ap.add_argument("--train-time-limit", type=float, default=1e9,
                    help="safety stop (seconds); the run is then no longer step-reproducible")
    ap.add_argument("--eval-lengths", default="2048,8192,32768,131072")
    ap.add_argument("--eval-depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--eval-samples", type=int, default=10)
    ap.add_argument("--eval-512k", type=int, default=0, help="needle samples per depth at 524288 tokens")
    ap.add_argument("--eval-1m", type=int, default=0, help="needle samples per depth at 1048576 tokens")
    ap.add_argument("--eval-time-limit", type=float, default=240)
    ap.add_argument("--eval-tasks", default="needle,passkey,variable_tracking,multi_doc",
                    help="passkey/variable_tracking/multi_doc run at 8k and 32k, 2 samples per depth")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the model already in --out")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaForCausalLM
    from transformers import masking_utils
    from transformers.masking_utils import create_causal_mask

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train.log", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    if a.eval_only:
        return run_eval(a, out, log, None)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    G.check_disjoint()
    Y.check_disjoint()
    shape, vocabulary, spec_of, default_recipe = MODELS[a.model]
    shape = {**shape, **a.shape}
    if ("heads" in a.shape or "head_dim" in a.shape) and "hidden" not in a.shape:
        shape["hidden"] = shape["heads"] * shape["head_dim"]
    a.recipe = a.recipe or default_recipe
    if a.model == "demo" and a.recipe not in G.RECIPES:
        raise SystemExit(f"--recipe {a.recipe} needs the yardstick's words: use it with --model yardstick")
    vocab = vocabulary()
    spec = spec_of(a.recipe)
    write_static_files(out, vocab, spec)
    t_setup = time.time()
    data = TrainData(vocab, spec, a.seed, pool_size=50_000 if a.smoke else 400_000, recipe=a.recipe)
    log(f"model {a.model} {shape}; recipe {a.recipe} {data.r}; vocab {len(vocab)}, sentence pool {len(data.lens)} "
        f"({data.avg_len:.1f} tokens avg) in {time.time() - t_setup:.1f}s")
    hist = distance_histogram(data, a.seed, a.steps, curriculum=a.curriculum)
    log(f"fact->question position distance, share of training sequences per decade: {json.dumps(hist)}")

    cfg = llama_config(vocab, shape)
    model = LlamaForCausalLM(cfg).cuda()  # sdpa attention (the default)
    if a.residual_init:
        with torch.no_grad():
            std = cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.normal_(0.0, std)
                layer.mlp.down_proj.weight.normal_(0.0, std)
    if a.init:
        init = LlamaForCausalLM.from_pretrained(a.init, dtype=torch.float32)
        missing = model.load_state_dict(init.state_dict(), strict=True)
        log(f"weights from {a.init} ({missing})")
        del init
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {torch.cuda.get_device_name()}")

    # PoSE needs the causal mask to ignore position jumps: with attention_mask=None transformers
    # reads jumps in position_ids as packed sequences and blocks attention across them. Training
    # sequences are never packed, so switch that detection off (then sdpa runs with is_causal).
    pj = torch.tensor([[0, 1, 2, 5000, 5001, 900000]], device="cuda")
    emb = torch.zeros(1, 6, cfg.hidden_size, device="cuda")
    assert create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=None, past_key_values=None, position_ids=pj) is not None
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    assert create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=None, past_key_values=None, position_ids=pj) is None

    steps = a.steps
    decay, no_decay = [], []
    for n_, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=True)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        p = (s - a.warmup) / max(1, steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            wi = torch.utils.data.get_worker_info()
            w, nw = (wi.id, wi.num_workers) if wi else (0, 1)
            for s in range(w, steps, nw):
                L = length_at(s, steps, a.curriculum)
                yield tuple(torch.from_numpy(x) for x in data.batch(a.seed, s, L, max(1, a.tokens_per_step // L)))

    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=a.workers, pin_memory=True,
                                         prefetch_factor=8 if a.workers else None, persistent_workers=False)
    curve = []
    model.train()
    t0 = time.time()
    zero = lambda: torch.zeros((), device="cuda")  # noqa: E731
    acc_loss, acc_n, acc_hit, acc_tok = zero(), 0, zero(), zero()
    last_t, last_s = t0, 0
    s = -1
    log(f"attention: {cfg._attn_implementation}; {a.tokens_per_step} tokens/step; {steps} steps; {a.workers} data workers")
    for s, (ids, tgt, pos) in enumerate(loader):
        ids, tgt, pos = (x.cuda(non_blocking=True) for x in (ids, tgt, pos))
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            sel = tgt != -100
            logits = model.lm_head(h[sel]).float()
        y = tgt[sel]
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            acc_loss += loss.detach()
            acc_n += 1
            acc_hit += (logits.argmax(-1) == y).sum()
            acc_tok += y.numel()
        if (s + 1) % 250 == 0 or s + 1 == steps or (a.smoke and (s + 1) % 20 == 0):
            now = time.time()
            L = ids.shape[1]
            rec = {"step": s + 1, "seq_len": L, "loss": float(acc_loss) / max(1, acc_n),
                   "answer_token_acc": float(acc_hit) / max(1.0, float(acc_tok)),
                   "lr": lr_at(s), "grad_norm": float(gn), "elapsed_s": round(now - t0, 1),
                   "tokens_per_s": round((s + 1 - last_s) * ids.numel() / (now - last_t))}
            curve.append(rec)
            log(f"step {s + 1}/{steps} L={L} loss {rec['loss']:.4f} ans_acc {rec['answer_token_acc']:.3f} "
                f"lr {rec['lr']:.2e} gn {rec['grad_norm']:.2f} {rec['tokens_per_s'] / 1e6:.2f}M tok/s {rec['elapsed_s']}s")
            acc_loss, acc_n, acc_hit, acc_tok = zero(), 0, zero(), zero()
            last_t, last_s = now, s + 1
        if time.time() - t0 > a.train_time_limit:
            log(f"train time limit reached at step {s + 1}")
            break
    train_s = time.time() - t0
    log(f"trained {s + 1} steps in {train_s:.0f}s")

    model.eval()
    export(model, out, vocab, spec)
    # the exported folder must reproduce the in-memory model
    re = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    x = torch.from_numpy(data.batch(a.seed, 10**9, 1024, 1)[0]).cuda()
    with torch.no_grad():
        for p_ in model.parameters():
            p_.data = p_.data.to(torch.bfloat16).float()
        ref = model(input_ids=x).logits.float()
        got = re(input_ids=x).logits.float()
    assert re.config.rope_parameters["rope_theta"] == ROPE_THETA, re.config.rope_parameters
    parity = float((ref - got).abs().max())
    log(f"export parity (fp32 forward, bf16 weights): max |logit diff| {parity:.2e}; "
        f"files: {sorted(p.name for p in out.iterdir())}")
    assert parity < 1e-2, parity
    del re

    scores = task_scores(model, data, a, log)
    final = [c["loss"] for c in curve[-4:]]
    training_log = {
        "command": " ".join(sys.argv), "model": a.model, "shape": shape, "residual_init": a.residual_init,
        "task_scores": scores,
        "seed": a.seed, "recipe": a.recipe, "recipe_settings": data.r,
        "fact_question_distance_histogram": hist, "steps_planned": steps, "steps_done": s + 1, "tokens_per_step": a.tokens_per_step,
        "curriculum": a.curriculum, "init": a.init, "lr": a.lr, "warmup": a.warmup, "parameters": n_params,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "train_seconds": round(train_s, 1),
        "final_loss": sum(final) / max(1, len(final)), "export_parity_max_abs_logit_diff": parity,
        "loss_curve": curve,
    }
    (out / "training_log.json").write_text(json.dumps(training_log, indent=1))
    log(f"train {train_s:.0f}s, final loss {training_log['final_loss']:.4f}")
    del model, opt
    run_eval(a, out, log, training_log)


def parse_shape(text: str) -> dict:
    """"layers=4,kv_heads=2" -> {"layers": 4, "kv_heads": 2}, keys of the shapes' (DEMO_SHAPE)."""
    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        if k not in DEMO_SHAPE or not v.isdigit() or int(v) < 1:
            raise SystemExit(f"--shape {text!r}: KEY=N pairs with keys {sorted(DEMO_SHAPE)}")
        out[k] = int(v)
    return out


def task_scores(model, data: TrainData, a, log) -> dict:
    """Per task of the recipe and length: the share of held-out answers whose every token is the
    model's argmax given the right ones before it (teacher forced), which is exactly the share a
    greedy decode would write out in full. Held-out: step seeds no run reaches."""
    import torch

    mix = data.r.get("tasks", {"passkey": 1, "kv": 1, "multi_doc": 1, "var": 1})
    out: dict = {}
    for L in (int(x) for x in a.task_eval_lengths.split(",")):
        for task in mix:
            rng = np.random.default_rng([a.seed, 2 * 10**9, L, sorted(mix).index(task)])
            right = 0
            for i in range(0, a.task_eval_samples, 8):
                n = min(8, a.task_eval_samples - i)
                ids, tgt, pos = (torch.from_numpy(np.stack(x)).cuda() for x in
                                 zip(*[data.sample(rng, L, None, task) for _ in range(n)]))
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                ok = (logits.argmax(-1) == tgt) | (tgt == -100)
                right += int(ok.all(-1).sum())
            out.setdefault(task, {})[L] = right / a.task_eval_samples
        log(f"task scores at {L} tokens (whole answer, teacher forced): "
            f"{json.dumps({t: out[t][L] for t in mix})}")
    return out


def run_eval(a, out: Path, log, training_log: dict | None) -> None:
    """Dense eval of the folder; results go into training_log.json ("eval", "eval_samples")."""
    import torch

    if training_log is None:
        p = out / "training_log.json"
        training_log = json.loads(p.read_text()) if p.exists() else {}
    depths = [float(d) for d in a.eval_depths.split(",")]
    lengths = [int(x) for x in a.eval_lengths.split(",")]
    names = a.eval_tasks.split(",")
    tasks = []
    if "needle" in names:
        tasks.append(("needle", None, None))
    tasks += [(t, [8192, 32768], 2) for t in ("passkey", "variable_tracking", "multi_doc") if t in names]
    if a.eval_512k:
        tasks.append(("needle", [524288], a.eval_512k))
    if a.eval_1m:
        tasks.append(("needle", [1048576], a.eval_1m))
    if a.smoke:
        tasks = [("needle", None, 1), ("variable_tracking", [4096], 1), ("multi_doc", [4096], 1), ("passkey", [4096], 1)]
        if a.eval_1m:
            tasks.append(("needle", [1048576], 1))
        depths = depths[2:3]
    t1 = time.time()
    results = evaluate(out, lengths, depths, a.eval_samples, tasks, a.seed, a.eval_time_limit, log)
    eval_s = time.time() - t1
    fresh = {(r["task"], r["length"]) for r in results}
    results = [r for r in training_log.get("eval_samples", []) if (r["task"], r["length"]) not in fresh] + results
    summary = {}
    for task in sorted({r["task"] for r in results}):
        summary[task] = {k: table(results, task, k) for k in
                         ("value_match", "exact_match", "prefilled_value_match", "prefilled_exact_match")}
    for task, t in summary.items():
        log(f"{task} value_match (generated) by length x depth: {json.dumps(t['value_match'])}")
        log(f"{task} value_match (prefilled) by length x depth: {json.dumps(t['prefilled_value_match'])}")
    runs = training_log.get("eval_runs", [])
    runs.append({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "seconds": round(eval_s, 1),
                 "lengths": sorted({L for _, L in fresh})})
    training_log.update({"eval_runs": runs, "eval": summary, "eval_samples": results})
    (out / "training_log.json").write_text(json.dumps(training_log, indent=1))
    log(f"eval done in {eval_s:.0f}s")


if __name__ == "__main__":
    main()
