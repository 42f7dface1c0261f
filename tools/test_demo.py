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
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import demo_grammar as G  # noqa: E402
import demo_prompts as P  # noqa: E402
from train_demo import TrainData, length_at, write_static_files  # noqa: E402


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
        write_static_files(model_dir, G.vocabulary(), G.eval_spec())
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

    # 2. TrainData.ids == tokenizer, and training sequences == rendered chat, loss on answers only
    data = TrainData(vocab, spec, seed=7, pool_size=5000)
    gen = P.SpecGen(spec, random.Random(3))
    for _ in range(2000):
        s = gen.sentence()
        assert data.ids(s) == enc(s), s
    for t in spec["document"]["title_templates"]:
        s = spec["document"]["header"].format(title=gen.fill(t))
        assert data.ids(s) == enc(s), s
    rng = np.random.default_rng(0)
    sp = {tok.token_to_id(t): t for t in G.SPECIALS}
    n_checked = 0
    for L in (256, 512, 1024, 4096):
        for _ in range(60):
            ids, tgt, pos = data.sample(rng, L)
            assert len(ids) == len(tgt) == len(pos) == L
            assert (np.diff(pos) >= 1).all() and pos[0] == 0 and pos[-1] < 1179648
            assert unk not in ids
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
    m = messages
    print(f"training sequences: {n_checked} parsed, re-rendered and re-tokenized identically; e.g. "
          f"{[(x['role'], x['content'][-120:]) for x in m]}")
    print("curriculum:", [length_at(s, 1000) for s in range(0, 1000, 100)])

    # 3. spec-only prompts: no <|unk|>, length <= target, answer checks
    count = lambda s: len(enc(s))  # noqa: E731
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
    p = P.make_prompt(spec, count, "needle", 4096, 0.5, random.Random(0))
    print("spec prompt example:", p["prompt"][:300].replace("\n", " | "), "...", p["prompt"][-200:].replace("\n", " | "))
    print("answer:", p["answer"])
    # demo_prompts must not depend on the training code
    src = (HERE / "demo_prompts.py").read_text()
    assert "demo_grammar" not in src and "train_demo" not in src
    print("all tests passed")


if __name__ == "__main__":
    main()
