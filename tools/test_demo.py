#!/usr/bin/env python3
"""CPU tests of the demo model's data, tokenizer, chat template and eval spec (no torch needed).

    python3 tools/test_demo.py [MODEL_DIR]

Without MODEL_DIR the tokenizer and spec are built from tools/demo_grammar.py; with it (e.g.
assets/models/demo) the shipped tokenizer.json, chat_template.jinja and eval_spec.json are tested.
Needs numpy, tokenizers, jinja2.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import demo_grammar as G  # noqa: E402
import demo_prompts as P  # noqa: E402
from demo_data import MAX_POS, TrainData, distance_histogram, length_at  # noqa: E402
from train_demo import write_static_files  # noqa: E402


def jinja_render(template: str, messages, add_generation_prompt: bool, bos: str) -> str:
    """transformers' way: sandboxed Jinja2 with trim_blocks and lstrip_blocks."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos, eos_token=G.END)


def main() -> None:
    if len(sys.argv) > 1:
        model_dir = Path(sys.argv[1])
    else:
        model_dir = Path(tempfile.mkdtemp())
        write_static_files(model_dir, G.vocabulary(), G.eval_spec(G.SHIPPED_RECIPE))
    spec, tok = P.load(model_dir)
    template = (model_dir / "chat_template.jinja").read_text()
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    gcfg = json.loads((model_dir / "generation_config.json").read_text())
    vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    assert vocab == G.vocabulary(), "tokenizer.json does not match demo_grammar's vocabulary"
    unk = tok.token_to_id(G.UNK)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    G.check_disjoint()
    print(f"vocab {len(vocab)}; specials {[(t, tok.token_to_id(t)) for t in G.SPECIALS]}")
    assert tcfg["bos_token"] == G.BOS and tcfg["eos_token"] == G.END
    assert gcfg["eos_token_id"] == [tok.token_to_id(G.END), tok.token_to_id(G.EOS)] and gcfg["do_sample"] is False

    # 1. chat template == Python twins
    msgs = [
        [{"role": "system", "content": "<|doc|> title : a b .\nthe secret code of amber falcon is 123 ."},
         {"role": "user", "content": "what is the secret code of amber falcon ?"}],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the pass key is 1 ."},
         {"role": "user", "content": "what is the pass key ?"}],
    ]
    for m in msgs:
        for agp in (True, False):
            j = jinja_render(template, m, agp, tcfg["bos_token"])
            assert j == G.render_chat(m, agp) == P.render_chat(m, agp), (j, G.render_chat(m, agp))
    try:
        jinja_render(template, [{"role": "tool", "content": "x"}], True, G.BOS)
        raise AssertionError("bad role accepted")
    except Exception as e:  # noqa: BLE001
        assert "roles must be" in str(e)
    print("chat template: jinja2 == render_chat")

    # 2. TrainData.ids == tokenizer, and training sequences == rendered chat, loss on answers only,
    #    for every recipe (the shipped spec's filler for the shipped recipe)
    assert spec == G.eval_spec(G.SHIPPED_RECIPE), f"the shipped eval_spec.json is not recipe {G.SHIPPED_RECIPE}'s"
    print(f"shipped spec == eval_spec({G.SHIPPED_RECIPE!r})")
    sp = {tok.token_to_id(t): t for t in G.SPECIALS}
    digit_ids = {tok.token_to_id(c) for c in "0123456789"}
    n_checked = 0
    for recipe in G.RECIPES:
        rspec = G.eval_spec(recipe)
        data = TrainData(vocab, rspec, seed=7, pool_size=5000, recipe=recipe)
        gen = P.SpecGen(rspec, random.Random(3))
        for _ in range(2000):
            s = gen.sentence()
            assert data.ids(s) == enc(s), s
        for t in rspec["document"]["title_templates"]:
            s = rspec["document"]["header"].format(title=gen.fill(t))
            assert data.ids(s) == enc(s), s
        n_checked += check_sequences(data, recipe, enc, tok, sp, unk, digit_ids)
        hist = distance_histogram(data, 1234, 14000, n=1500)
        print(f"recipe {recipe}: fact->question distance per decade {hist}")
        if G.RECIPES[recipe]["pose"] == "fact_distance":
            # log-uniform over [100, ~1.1M]: every decade from 100 up holds a fair share
            for k in ("[1000,10000)", "[10000,100000)", "[100000,1000000)"):
                assert hist[k] > 0.15, (k, hist)
    print("curriculum:", [length_at(s, 1000) for s in range(0, 1000, 100)])
    spec_prompts(spec, tok, enc, unk)
    for recipe in G.RECIPES:
        if recipe != G.SHIPPED_RECIPE:
            with tempfile.TemporaryDirectory() as d:
                write_static_files(Path(d), vocab, G.eval_spec(recipe))
                rspec, rtok = P.load(d)
                spec_prompts(rspec, rtok, lambda s: rtok.encode(s, add_special_tokens=False).ids, unk)
            print(f"spec prompts of recipe {recipe}: ok")
    # demo_prompts must not depend on the training code
    src = (HERE / "demo_prompts.py").read_text()
    assert "demo_grammar" not in src and "train_demo" not in src
    print(f"all tests passed ({n_checked} training sequences)")


def check_sequences(data, recipe, enc, tok, sp, unk, digit_ids) -> int:
    rng = np.random.default_rng(0)
    n_checked = 0
    value_digits = G.RECIPES[recipe]["value_digits"]
    info: dict = {}
    n_decoyed = 0
    passkey_facts: list[int] = []  # key-value facts in each pass-key sequence
    for L in (256, 512, 1024, 4096):
        for _ in range(60):
            ids, tgt, pos = data.sample(rng, L, info)
            assert len(ids) == len(tgt) == len(pos) == L
            assert (np.diff(pos) >= 1).all() and pos[0] == 0 and pos[-1] < MAX_POS
            assert 0 < info["distance"] < MAX_POS
            assert unk not in ids
            if not G.RECIPES[recipe]["filler_numbers"]:
                # the only digit runs are planted values (and their copies in answers)
                runs, n = [], 0
                for t in list(ids) + [-1]:
                    if int(t) in digit_ids:
                        n += 1
                    elif n:
                        runs.append(n)
                        n = 0
                assert runs and all(value_digits[0] <= r <= value_digits[1] for r in runs), runs
            if info["task"] == "passkey":
                text = tok.decode([int(t) for t in ids], skip_special_tokens=False)
                kv_facts = len(re.findall(r"the (?:%s) of [a-z]+ [a-z]+ is \d" % "|".join(G.RELATIONS), text))
                passkey_facts.append(kv_facts)
            if G.RECIPES[recipe]["decoys"]:
                n_decoyed += info["decoys"] > 0
                # every decoy record is a digit run that shares >= 2 digits with an answered value
                # and is not one (filler runs may also share some by chance: hence >=)
                digits = "".join(tok.id_to_token(int(t)) if int(t) in digit_ids else " " for t in ids).split()
                pairs = {v[j:j + 2] for v in info["answered"] for j in range(len(v) - 1)}
                near = [r for r in digits if r not in info["answered"] and any(r[j:j + 2] in pairs for j in range(len(r) - 1))]
                assert len(near) >= info["decoys"], (near, info)
            # parse into messages
            assert ids[0] == tok.token_to_id(G.BOS)
            messages, i = [], 1
            end = L
            while int(ids[end - 1]) == tok.token_to_id(G.PAD):
                end -= 1
            assert L - end < 60, L - end
            while i < end:
                role = sp[int(ids[i])][2:-2]
                j = i + 1
                while int(ids[j]) != tok.token_to_id(G.END):
                    j += 1
                messages.append({"role": role, "content": tok.decode([int(x) for x in ids[i + 1:j]], skip_special_tokens=False)})
                i = j + 1
            assert enc(G.render_chat(messages, False)) == [int(x) for x in ids[:end]], messages
            # targets: exactly the assistant contents and their <|end|>
            want = np.full(L, -100)
            k = 1
            for m in messages:
                n = len(enc(m["content"]))
                if m["role"] == "assistant":
                    want[k:k + n + 1] = ids[k + 1:k + n + 2]  # predicts content and <|end|>
                k += n + 2
            assert (want == tgt).all()
            n_checked += 1
    if G.RECIPES[recipe]["passkey_among_facts"]:
        assert passkey_facts and np.mean(passkey_facts) > 1.0 and max(passkey_facts) >= 4, passkey_facts
        print(f"recipe {recipe}: pass-key sequences hold {np.mean(passkey_facts):.1f} other facts on average")
    else:
        assert not any(passkey_facts), passkey_facts
    if G.RECIPES[recipe]["decoys"]:
        share = n_decoyed / n_checked
        assert abs(share - G.DECOY_SEQUENCE_SHARE) < 0.12, share
        print(f"recipe {recipe}: {share:.0%} of sequences hold decoy records")
    m = messages
    print(f"recipe {recipe}: {n_checked} training sequences parsed, re-rendered and re-tokenized identically; e.g. "
          f"{[(x['role'], x['content'][-120:]) for x in m]}")
    return n_checked


def spec_prompts(spec, tok, enc, unk) -> None:
    """3. spec-only prompts: no <|unk|>, length <= target, answer checks, prefilled prompts."""
    count = lambda s: len(enc(s))  # noqa: E731
    numbers = bool(spec["filler"]["number_slots"])
    for task in spec["tasks"]:
        for L in (2048, 8192):
            for d in (0.0, 0.25, 0.5, 0.75, 1.0):
                for role in ("system", "user"):
                    p = P.make_prompt(spec, count, task, L, d, random.Random(f"{task}{L}{d}"), role)
                    ids = enc(p["prompt"])
                    assert unk not in ids and unk not in enc(p["answer"]), p["prompt"]
                    assert L - 40 <= len(ids) <= L, (task, L, len(ids))
                    assert P.value_match(p["answer"], p["answer_prefix"], p["value"])
                    assert P.value_match(" ".join(tok.decode(enc(p["answer"])).split()), p["answer_prefix"], p["value"])
                    assert not P.value_match(p["answer"].replace(p["value"][-1] + " .", "x ."), p["answer_prefix"], p["value"])
                    # the fact sits at the depth asked for
                    fact_text = p["answer"] if task in ("needle", "passkey") else None
                    if fact_text and role == "system":
                        body = p["messages"][0]["content"]
                        where = body.find(fact_text) / len(body)
                        assert abs(where - d) < 0.05, (task, d, where)
                    if not numbers:  # the only digits are the facts' values
                        runs = re.findall(r"[0-9]+", p["prompt"])
                        assert runs and all(len(r) == spec["value"]["digits"] for r in runs), runs
                        assert len(re.findall(r" is [0-9]+ \.", p["prompt"])) == len(runs)
                if task in ("needle", "passkey"):
                    p = P.make_prompt(spec, count, task, L, 0.5, random.Random(f"{task}{L}"), None, True)
                    ids = enc(p["prompt"])
                    pre = enc(p["answer_prefix"])
                    assert p["prefilled"] and ids[-len(pre):] == pre and L - 40 <= len(ids) <= L, (L, len(ids))
                    assert enc(p["answer"])[:len(pre)] == pre
    p = P.make_prompt(spec, count, "needle", 4096, 0.5, random.Random(0))
    print("spec prompt example:", p["prompt"][:300].replace("\n", " | "), "...", p["prompt"][-200:].replace("\n", " | "))
    print("answer:", p["answer"])


if __name__ == "__main__":
    main()
