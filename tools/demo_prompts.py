"""Prompt generator for Folio's demo model that reads ONLY a model folder's eval_spec.json.

This is the reference implementation of the algorithm in docs/demo-model.md ("eval_spec.json"):
a Rust implementation (`folio eval needle`) that follows the same steps produces prompts of the
same distribution (not the same random draws: the RNG differs). It needs no training code:

    python3 tools/demo_prompts.py assets/models/demo --length 2048 --depth 0.5 --seed 1

prints the chat messages, the rendered prompt's token count and the expected answer.

Token counts use the model's tokenizer.json (`tokenizers` package).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SLOT = re.compile(r"\{([a-z_0-9]+)\}")


class SpecGen:
    """Fills the templates of an eval_spec.json with a `random.Random`."""

    def __init__(self, spec: dict, rng: random.Random):
        self.spec = spec
        self.rng = rng
        self.slots = spec["filler"]["slots"]
        self.numbers = spec["filler"]["number_slots"]
        self.templates = spec["filler"]["templates"]

    def fill(self, template: str, **fixed: str) -> str:
        """Replace each {slot} independently: fixed values first, then word lists, then numbers."""

        def one(m: re.Match) -> str:
            name = m.group(1)
            if name in fixed:
                return fixed[name]
            if name in self.slots:
                return self.rng.choice(self.slots[name])
            if name in self.numbers:
                n = self.numbers[name]
                d = self.rng.randint(n["digits_min"], n["digits_max"])
                lo = 0 if d == 1 else 10 ** (d - 1)
                return str(self.rng.randint(max(lo, 1), 10**d - 1))
            raise KeyError(f"no value for slot {{{name}}}")

        return SLOT.sub(one, template)

    def sentence(self) -> str:
        return self.fill(self.rng.choice(self.templates))

    def title(self) -> str:
        return self.fill(self.rng.choice(self.spec["document"]["title_templates"]))

    def keys(self, n: int) -> list[str]:
        """n distinct keys "{adj} {noun}"."""
        k = self.spec["keys"]
        out: list[str] = []
        while len(out) < n:
            key = k["format"].format(adj=self.rng.choice(k["adjectives"]), noun=self.rng.choice(k["nouns"]))
            if key not in out:
                out.append(key)
        return out

    def value(self, digits: int | None = None) -> str:
        v = self.spec["value"]
        d = digits or v["digits"]
        return "".join(self.rng.choice(v["alphabet"]) for _ in range(d))


def render_chat(messages: list[dict], add_generation_prompt: bool, bos: str = "<|bos|>") -> str:
    """Same output as chat_template.jinja rendered with HF semantics (tests compare them)."""
    s = bos
    for m in messages:
        s += f"<|{m['role']}|> {m['content']} <|end|>\n"
    if add_generation_prompt:
        s += "<|assistant|> "
    return s


def _documents(spec: dict, gen: SpecGen, sentences: list[str], facts: list[tuple[int, str]], n_docs: int,
               titles: list[str]) -> str:
    """Place facts (index, text) before sentence `index` (index == len: after the last one),
    split the sentence list evenly into n_docs documents, and render them."""
    d = spec["document"]
    n = len(sentences)
    at: dict[int, list[str]] = {}
    for i, f in facts:
        at.setdefault(i, []).append(f)
    bounds = [round(k * n / n_docs) for k in range(n_docs + 1)]
    docs = []
    for k in range(n_docs):
        items: list[str] = []
        for i in range(bounds[k], bounds[k + 1]):
            items.extend(at.get(i, []))
            items.append(sentences[i])
        if k == n_docs - 1:
            items.extend(at.get(n, []))
        header = d["header"].format(title=titles[k])
        docs.append(header + d["header_separator"] + d["sentence_separator"].join(items))
    return d["document_separator"].join(docs)


def make_prompt(spec: dict, count_tokens, task: str, length: int, depth: float, rng: random.Random,
                documents_role: str | None = None, prefill: bool = False) -> dict:
    """One eval prompt of about `length` tokens (never more) with the target fact at `depth`.

    prefill (spec["chat"]["prefill_answer_prefix"]): the prompt continues after the generation
    prompt with the answer prefix, which counts towards `length`; the model then only has to
    produce the value (for needle and passkey; the prefix is where the answer starts).

    Returns {"messages", "prompt" (rendered, with generation prompt, and the answer prefix if
    prefilled), "answer", "answer_prefix", "value", "task", "depth", "prefilled"}.
    """
    gen = SpecGen(spec, rng)
    t = spec["tasks"][task]
    n_docs = t["documents"]
    titles = [gen.title() for _ in range(n_docs)]
    # facts as (depth in [0,1] or None = uniform, text); "slot" tells which document for multi_doc
    if task == "needle":
        keys = gen.keys(1 + t["distractors"])
        rels = [rng.choice(t["relations"]) for _ in keys]
        vals = [gen.value() for _ in keys]
        facts = [(depth, t["fact"].format(relation=r, key=k, value=v)) for r, k, v in zip(rels, keys, vals)]
        facts = facts[:1] + [(None, f) for _, f in facts[1:]]
        question = t["question"].format(relation=rels[0], key=keys[0])
        answer = t["answer"].format(relation=rels[0], key=keys[0], value=vals[0])
        prefix = t["answer_prefix"].format(relation=rels[0], key=keys[0])
        value = vals[0]
    elif task == "passkey":
        value = gen.value()
        facts = [(depth, t["fact"].format(value=value))]
        question, answer, prefix = t["question"], t["answer"].format(value=value), t["answer_prefix"]
    elif task == "variable_tracking":
        names = rng.sample(t["variables"], t["hops"] + 1 + t["distractors"])
        chain, others = names[: t["hops"] + 1], names[t["hops"] + 1:]
        value = gen.value()
        # chain[0] holds the value; chain[j] = chain[j-1]. The fact is at `depth`, links uniform.
        facts = [(depth, t["fact"].format(var=chain[0], value=value))]
        facts += [(None, t["link"].format(var=chain[j], source=chain[j - 1])) for j in range(1, len(chain))]
        facts += [(None, t["fact"].format(var=o, value=gen.value())) for o in others]
        asked = chain[-1]
        question = t["question"].format(var=asked)
        parts = [t["link"].format(var=chain[j], source=chain[j - 1]) for j in range(len(chain) - 1, 0, -1)]
        parts.append(t["fact"].format(var=chain[0], value=value))
        answer = " ".join(parts)
        prefix = t["answer_prefix"].format(var0=chain[0])
    elif task == "multi_doc":
        keys = gen.keys(2 + t["distractors"])
        rels = [rng.choice(t["relations"]) for _ in keys]
        vals = [gen.value() for _ in keys]
        fact = spec["tasks"]["needle"]["fact"]
        texts = [fact.format(relation=r, key=k, value=v) for r, k, v in zip(rels, keys, vals)]
        # the first asked fact sits at `depth`; the second in a different document (uniform there)
        facts = [(depth, texts[0]), ("other", texts[1])] + [(None, x) for x in texts[2:]]
        question = t["question"].format(relation=rels[0], key=keys[0], relation2=rels[1], key2=keys[1])
        a = spec["tasks"]["needle"]["answer"]
        answer = a.format(relation=rels[0], key=keys[0], value=vals[0]) + " " + a.format(
            relation=rels[1], key=keys[1], value=vals[1])
        prefix = spec["tasks"]["needle"]["answer_prefix"].format(relation=rels[1], key=keys[1])
        value = vals[1]
    else:
        raise ValueError(task)

    chat = spec["chat"]
    role = documents_role or chat["documents_role"]

    def messages_for(docs: str) -> list[dict]:
        if role == "system":
            return [{"role": "system", "content": docs}, {"role": "user", "content": question}]
        return [{"role": "user", "content": docs + chat["documents_in_user_separator"] + question}]

    # 1. token count of everything but the filler
    skeleton = _documents(spec, gen, [], [(0, f) for _, f in facts], n_docs, titles)
    fixed = count_tokens(render_chat(messages_for(skeleton), True) + (prefix if prefill else ""))
    budget = length - fixed
    # 2. filler sentences while they fit
    sentences: list[str] = []
    total = 0
    while True:
        s = gen.sentence()
        c = count_tokens(s)
        if total + c > budget:
            break
        sentences.append(s)
        total += c
    n = len(sentences)
    # 3. fact positions: a sentence index in [0, n]
    placed: list[tuple[int, str]] = []
    bounds = [round(k * n / n_docs) for k in range(n_docs + 1)]
    first_doc = None
    for d, text in facts:
        if d == "other":
            docs_left = [k for k in range(n_docs) if k != first_doc]
            k = rng.choice(docs_left)
            placed.append((rng.randint(bounds[k], max(bounds[k], bounds[k + 1] - 1)), text))
        elif d is None:
            placed.append((rng.randint(0, n), text))
        else:
            i = round(d * n)
            placed.append((i, text))
            first_doc = min(max(k for k in range(n_docs) if bounds[k] <= i), n_docs - 1) if n else 0
    docs = _documents(spec, gen, sentences, placed, n_docs, titles)
    messages = messages_for(docs)
    return {
        "task": task,
        "depth": depth,
        "messages": messages,
        "prompt": render_chat(messages, True) + (prefix if prefill else ""),
        "prefilled": prefill,
        "answer": answer,
        "answer_prefix": prefix,
        "value": value,
    }


def value_match(generated: str, prefix: str, value: str) -> bool:
    """spec["check"]["value_match"]: text after the last answer prefix, up to '.', spaces removed."""
    g = " ".join(generated.split())
    i = g.rfind(prefix)
    if i < 0:
        return False
    rest = g[i + len(prefix):].split(".")[0]
    return rest.replace(" ", "") == value


def load(model_dir: str | Path):
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    spec = json.loads((model_dir / "eval_spec.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / spec["tokenizer"]))
    return spec, tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--task", default="needle")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--documents-role", choices=["system", "user"], default=None)
    ap.add_argument("--prefill", choices=["spec", "yes", "no"], default="spec",
                    help="end the prompt with the answer prefix (default: the spec's chat.prefill_answer_prefix)")
    a = ap.parse_args()
    spec, tok = load(a.model_dir)
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    prefill = spec["chat"].get("prefill_answer_prefix", False) if a.prefill == "spec" else a.prefill == "yes"
    p = make_prompt(spec, count, a.task, a.length, a.depth, random.Random(a.seed), a.documents_role, prefill)
    ids = tok.encode(p["prompt"], add_special_tokens=False).ids
    print(json.dumps(p["messages"], indent=1)[:3000])
    print(f"tokens: {len(ids)}  unk: {ids.count(tok.token_to_id('<|unk|>'))}  prefilled: {p['prefilled']}")
    print(f"prompt ends: ...{p['prompt'][-120:]!r}")
    print(f"answer: {p['answer']}\nprefix: {p['answer_prefix']}\nvalue:  {p['value']}")


if __name__ == "__main__":
    main()
