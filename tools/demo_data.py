"""The demo model's training data at the level of token ids (tools/train_demo.py): batches of
the same distribution as demo_prompts.make_prompt, drawn fast enough to keep a GPU busy, the
curriculum of lengths over a run, and the distance histogram a run logs. Seeded: the data of
step s comes from numpy's default_rng([seed, s]). The yardstick's recipe (yardstick_tasks.RECIPES)
adds the RULER-style suite's tasks to the mix; the demo's recipes draw exactly what they drew before.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_grammar as G  # noqa: E402
import yardstick_tasks as Y  # noqa: E402
from demo_prompts import SpecGen, make_prompt  # noqa: E402

MAX_POS = 1179648  # 2^20 + 2^17: a 2^20-token prompt plus its answer fits
ROPE_THETA = 2_000_000.0
# the demo's task mix (shares of training sequences); a recipe's "tasks" replaces it
DEMO_TASKS = {"passkey": 0.1, "kv": 0.5, "multi_doc": 0.2, "var": 0.2}
CURRICULUM = [(256, 0.10), (512, 0.10), (1024, 0.15), (2048, 0.20), (4096, 0.45)]


# ======================================================================================
# Fast id-level training data (same distribution as demo_prompts.make_prompt)
# ======================================================================================
class TrainData:
    def __init__(self, vocab: list[str], spec: dict, seed: int, pool_size: int = 400_000,
                 recipe: str = G.DEFAULT_RECIPE):
        self.spec = spec
        self.recipe = recipe
        self.r = {**G.RECIPES, **Y.RECIPES}[recipe]
        self.w2i = {w: i for i, w in enumerate(vocab)}
        self.sp = {t: self.w2i[t] for t in G.SPECIALS}
        gen = SpecGen(spec, random.Random(seed))
        texts = [gen.sentence() for _ in range(pool_size)]
        sents = [self.ids(t) for t in texts]
        # the recite task copies whole sentences, so it needs their text
        self.texts = texts if "recite" in self.r.get("tasks", {}) else []
        self.lens = np.array([len(s) for s in sents], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lens)[:-1]])
        self.flat = np.concatenate(sents).astype(np.int64)
        self.avg_len = float(self.lens.mean())
        self.titles = [self.ids(G.DOC_HEADER.format(title=gen.title())) for _ in range(4096)]
        self._cache: dict[str, list[int]] = {}
        # decoy records: filler sentences with a number slot, split around their first number
        # (drawn after the pool and titles, so recipes without decoys keep run 1's data stream)
        self.shells: list[tuple[list[int], list[int]]] = []
        if self.r["decoys"]:
            numbered = [t for t in spec["filler"]["templates"] if "{num}" in t]
            for _ in range(4096):
                b, a = gen.fill(gen.rng.choice(numbered).replace("{num}", "@", 1)).split("@")
                self.shells.append((self.ids(b), self.ids(a)))

    def ids(self, text: str) -> list[int]:
        """Word-level ids, identical to tokenizer.json on this vocabulary (tests check it)."""
        out: list[int] = []
        for w in text.split():
            if w.isdigit():
                out.extend(self.w2i[c] for c in w)
            else:
                out.append(self.w2i[w])
        return out

    def cids(self, text: str) -> list[int]:
        r = self._cache.get(text)
        if r is None:
            r = self._cache[text] = self.ids(text)
        return r

    # ---- pieces -------------------------------------------------------------------
    def filler(self, rng: np.random.Generator, budget: int):
        """Whole filler sentences of at most `budget` tokens in all, and their start offsets
        (plus the end offset). The shortfall (< one sentence) becomes <|pad|> after the answer."""
        k = int(budget / self.avg_len * 1.25) + 8
        idx = rng.integers(0, len(self.lens), k)
        cs = np.cumsum(self.lens[idx])
        while cs[-1] <= budget:
            idx = np.concatenate([idx, rng.integers(0, len(self.lens), k)])
            cs = np.cumsum(self.lens[idx])
        m = int(np.searchsorted(cs, budget, side="right"))  # sentences that fit
        if m == 0:
            return np.zeros(0, dtype=np.int64), np.array([0])
        idx, cs = idx[:m], cs[:m]
        sent_start = np.concatenate([[0], cs[:-1]])
        tok = np.repeat(self.starts[idx] - sent_start, self.lens[idx]) + np.arange(cs[-1])
        return self.flat[tok], np.concatenate([sent_start, [cs[-1]]])

    def sentence_text(self, rng) -> str:
        return self.texts[int(rng.integers(len(self.texts)))]

    def value(self, rng) -> str:
        lo, hi = self.r["value_digits"]
        n = lo if lo == hi else int(rng.integers(lo, hi + 1))
        return "".join(str(d) for d in rng.integers(0, 10, n))

    def similar_value(self, rng, v: str) -> str:
        """A value that starts with a run of >= 2 digits taken from anywhere in `v`, and is not `v`
        (it may be `v` cut short: then only the stop tells them apart)."""
        w = list(self.value(rng))
        s = int(rng.integers(0, len(v) - 1))
        p = int(rng.integers(2, min(len(v) - s, len(w)) + 1))
        w[:p] = v[s:s + p]
        if "".join(w) == v:
            w[-1] = str((int(w[-1]) + 1) % 10)
        return "".join(w)

    def decoy(self, rng, v: str) -> list[int]:
        """A filler record whose number shares a run of >= 2 digits with `v` and then goes on
        differently: another digit where `v` goes on, 1-2 more digits where `v` stops."""
        s = int(rng.integers(0, len(v) - 1))
        p = int(rng.integers(2, len(v) - s + 1))
        num = v[s:s + p]
        if s + p < len(v):
            num += str((int(v[s + p]) + int(rng.integers(1, 10))) % 10)
        num += "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(0 if s + p < len(v) else 1, 3))))
        b, a = self.shells[int(rng.integers(len(self.shells)))]
        return b + self.ids(num) + a

    def keys(self, rng, n: int, confusable: bool) -> list[str]:
        A, N = G.KEY_ADJS, G.KEY_NOUNS
        a0, n0 = int(rng.integers(len(A))), int(rng.integers(len(N)))
        out = [(a0, n0)]
        while len(out) < n:
            r = rng.random()
            if confusable and r < 0.35:
                k = (a0, int(rng.integers(len(N))))
            elif confusable and r < 0.7:
                k = (int(rng.integers(len(A))), n0)
            else:
                k = (int(rng.integers(len(A))), int(rng.integers(len(N))))
            if k not in out:
                out.append(k)
        order = rng.permutation(n)  # the asked key is not always the "base" of the confusables
        return [f"{A[out[i][0]]} {N[out[i][1]]}" for i in order]

    # ---- one sequence ---------------------------------------------------------------
    def sample(self, rng: np.random.Generator, L: int, info: dict | None = None, force: str | None = None):
        """(ids, loss targets for next-token prediction, position ids), each of length L.
        `info`, if given, receives the task and the position-id distance from the asked fact
        (the one whose value the first answer copies) to the first question. `force` sets the
        task (held-out scoring per task); else the recipe's mix draws it."""
        sp = self.sp
        short = L <= 512
        mix = self.r.get("tasks", DEMO_TASKS)
        task = force or rng.choice(list(mix), p=list(mix.values()))
        n_docs = int(rng.integers(1, 3 if short else 5))
        facts: list[tuple[str, object]] = []  # (text, place: None, a document or an ordered group)
        turns: list[tuple[str, str]] = []  # (question, answer)
        if task in Y.DRAWN:
            got = Y.draw(str(task), rng, self, short)
            facts, turns, answered, target = got["facts"], got["turns"], got["answered"], 0
            if any(p in ("A", "B") for _, p in facts):
                n_docs = max(n_docs, 2)
                d1, d2 = (int(x) for x in rng.choice(n_docs, 2, replace=False))
                facts = [(f, d1 if p == "A" else d2 if p == "B" else p) for f, p in facts]
        elif task == "passkey":
            v = self.value(rng)
            target = 0
            facts.append((G.PASSKEY_FACT.format(value=v), None))
            turns.append((G.PASSKEY_QUESTION, G.PASSKEY_ANSWER.format(value=v)))
            answered = [v]
            if self.r["passkey_among_facts"]:
                # other facts beside the pass key, as in a user's documents (assets/samples)
                n = int(rng.integers(0, 3 if short else 8))
                for k in self.keys(rng, n, confusable=False) if n else []:
                    rel = G.RELATIONS[int(rng.integers(len(G.RELATIONS)))]
                    facts.append((G.KV_FACT.format(relation=rel, key=k, value=self.value(rng)), None))
        elif task == "kv":
            n = int(rng.integers(1, (3 if L <= 256 else 5 if short else 9)))
            keys = self.keys(rng, n, confusable=rng.random() < 0.5)
            rels = [G.RELATIONS[int(rng.integers(len(G.RELATIONS)))] for _ in keys]
            vals = [self.value(rng) for _ in keys]
            asked = rng.permutation(n)[: int(rng.integers(1, min(n, 3) + 1))]
            target = int(asked[0])
            if self.r["decoys"] and rng.random() < G.DECOY_VALUE_SHARE:
                vals = [v if i == target else self.similar_value(rng, vals[target]) for i, v in enumerate(vals)]
            for r, k, v in zip(rels, keys, vals):
                facts.append((G.KV_FACT.format(relation=r, key=k, value=v), None))
            for i in asked:
                turns.append((G.KV_QUESTION.format(relation=rels[i], key=keys[i]),
                              G.KV_ANSWER.format(relation=rels[i], key=keys[i], value=vals[i])))
            answered = [vals[i] for i in asked]
        elif task == "multi_doc":
            n_docs = max(n_docs, 2)
            n = 2 + int(rng.integers(0, 2 if short else 4))
            keys = self.keys(rng, n, confusable=rng.random() < 0.3)
            rels = [G.RELATIONS[int(rng.integers(len(G.RELATIONS)))] for _ in keys]
            vals = [self.value(rng) for _ in keys]
            if self.r["decoys"] and rng.random() < G.DECOY_VALUE_SHARE:
                vals = [vals[0]] + [self.similar_value(rng, vals[0]) for _ in vals[1:]]
            d1, d2 = rng.choice(n_docs, 2, replace=False)
            target = 0
            for i, (r, k, v) in enumerate(zip(rels, keys, vals)):
                facts.append((G.KV_FACT.format(relation=r, key=k, value=v), int(d1) if i == 0 else int(d2) if i == 1 else None))
            q = G.PAIR_QUESTION.format(relation=rels[0], key=keys[0], relation2=rels[1], key2=keys[1])
            a = G.KV_ANSWER.format(relation=rels[0], key=keys[0], value=vals[0]) + " " + G.KV_ANSWER.format(
                relation=rels[1], key=keys[1], value=vals[1])
            turns.append((q, a))
            answered = vals[:2]
        else:  # variable tracking
            hops = int(rng.integers(0, self.r.get("max_hops", 2) + 1))
            extra = int(rng.integers(0, 2 if short else 3 if hops <= 2 else 5))
            names = [G.VARIABLES[i] for i in rng.choice(len(G.VARIABLES), hops + 1 + extra, replace=False)]
            chain, others = names[: hops + 1], names[hops + 1:]
            v = self.value(rng)
            target = 0
            facts.append((G.VAR_FACT.format(var=chain[0], value=v), None))
            for j in range(1, len(chain)):
                facts.append((G.VAR_LINK.format(var=chain[j], source=chain[j - 1]), None))
            similar = self.r["decoys"] and rng.random() < G.DECOY_VALUE_SHARE
            for o in others:
                facts.append((G.VAR_FACT.format(var=o, value=self.similar_value(rng, v) if similar else self.value(rng)), None))
            parts = [G.VAR_LINK.format(var=chain[j], source=chain[j - 1]) for j in range(hops, 0, -1)]
            parts.append(G.VAR_FACT.format(var=chain[0], value=v))
            turns.append((G.VAR_QUESTION.format(var=chain[-1]), " ".join(parts)))
            answered = [v]
        decoys: list[list[int]] = []
        if self.r["decoys"] and rng.random() < G.DECOY_SEQUENCE_SHARE:
            numbers = [a for a in answered if a.isdigit() and len(a) >= 2]  # decoys mimic values only
            for _ in range(int(rng.integers(1, G.max_decoys(L) + 1)) if numbers else 0):
                decoys.append(self.decoy(rng, numbers[int(rng.integers(len(numbers)))]))

        docs_in_user = rng.random() < 0.3
        headers = [self.titles[int(rng.integers(len(self.titles)))] for _ in range(n_docs)]
        fact_ids = [self.cids(f) if task not in Y.DRAWN else self.ids(f) for f, _ in facts] + decoys
        facts += [("", None)] * len(decoys)
        # tail: questions and answers, with the loss mask
        tail: list[int] = []
        mask: list[int] = []

        def put(ids, m):
            tail.extend(ids)
            mask.extend([m] * len(ids))

        for t, (q, a) in enumerate(turns):
            if t == 0:
                put(([] if docs_in_user else [sp[G.END], sp[G.USER]]) + self.cids(q) + [sp[G.END], sp[G.ASSISTANT]], 0)
            else:
                put([sp[G.USER]] + self.cids(q) + [sp[G.END], sp[G.ASSISTANT]], 0)
            put(self.cids(a) + [sp[G.END]], 1)
        head = [sp[G.BOS], sp[G.USER] if docs_in_user else sp[G.SYSTEM]]
        fixed = len(head) + sum(len(h) for h in headers) + sum(len(f) for f in fact_ids) + len(tail)
        budget = L - fixed
        if budget < 8:  # too many parts for this length: try again
            return self.sample(rng, L, info, force)
        toks, bounds = self.filler(rng, budget)
        nb = len(bounds)
        # document starts: doc 0 at 0, the others at distinct sentence boundaries
        cuts = np.sort(rng.choice(np.arange(1, nb - 1), n_docs - 1, replace=False)) if n_docs > 1 and nb - 2 >= n_docs - 1 else np.array([], dtype=np.int64)
        n_docs = 1 + len(cuts)
        doc_b = np.concatenate([[0], cuts, [nb - 1]])  # boundary index ranges per document
        events = [(0, 0, i, h) for i, h in enumerate(headers[:1])]
        for j, c in enumerate(cuts):
            events.append((int(bounds[c]), 0, j + 1, headers[j + 1]))
        ordered: dict[object, list[int]] = {}  # group -> indices into events, in fact order
        for i, ((_, doc), f) in enumerate(zip(facts, fact_ids)):
            r = rng.random()
            if isinstance(doc, tuple):  # ("ordered", group): anywhere, the group kept in order
                ordered.setdefault(doc, []).append(len(events))
                doc = None
            if doc is not None and doc < n_docs:
                lo, hi = int(doc_b[doc]), int(doc_b[doc + 1])
                hi = hi if doc == n_docs - 1 else hi - 1  # a fact at a cut belongs to the next doc
                b = int(rng.integers(lo, max(lo, hi) + 1))
            elif r < 0.05:
                b = 0
            elif r < 0.1:
                b = nb - 1
            else:
                b = int(rng.integers(0, nb))
            events.append((int(bounds[b]), 1, i, f))
        for group in ordered.values():  # the drawn places, sorted, given to the facts in order
            at_ = sorted(events[j][0] for j in group)
            for j, p in zip(group, at_):
                events[j] = (p,) + events[j][1:]
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        pieces = [np.array(head)]
        prev = 0
        at = len(head)
        fact_span = (0, 0)  # [start, end) of the asked fact in the sequence
        for pos, kind, i, arr in events:
            pieces.append(toks[prev:pos])
            at += pos - prev
            pieces.append(np.asarray(arr))
            if kind == 1 and i == target:
                fact_span = (at, at + len(arr))
            at += len(arr)
            prev = pos
        pieces.append(toks[prev:])
        hay = np.concatenate(pieces)
        n_pad = L - len(hay) - len(tail)
        ids = np.concatenate([hay, np.array(tail), np.full(n_pad, sp[G.PAD])]).astype(np.int64)
        assert len(ids) == L, (len(ids), L)
        lm = np.concatenate([np.zeros(len(hay), dtype=bool), np.array(mask, dtype=bool), np.zeros(n_pad, dtype=bool)])
        tgt = np.full(L, -100, dtype=np.int64)
        tgt[:-1] = np.where(lm[1:], ids[1:], -100)
        pos = np.arange(L, dtype=np.int64)
        if self.r["pose"] == "random_cuts":
            # run 1: gaps at 1-2 random points inside the documents, adding up to a log-uniform
            # maximum position
            if rng.random() < 0.8 and len(hay) > 4:
                max_pos = math.exp(rng.uniform(math.log(2 * L), math.log(MAX_POS - 1)))
                skip = max(0.0, max_pos - L)
                n_cut = int(rng.integers(1, 3))
                cps = np.sort(rng.choice(np.arange(2, len(hay)), n_cut, replace=False))
                gaps = rng.dirichlet(np.ones(n_cut)) * skip
                for c, g in zip(cps, np.floor(gaps).astype(np.int64)):
                    pos[c:] += g
        else:
            # run 3: one skip between the asked fact and the question, so that their distance is
            # log-uniform in [POSE_MIN_DISTANCE, MAX_POS - L] (or the natural distance, if that
            # is larger); half the time also a uniform skip before the fact, which moves the
            # whole window up to the last position id (< MAX_POS)
            f0, f1 = fact_span
            d0 = len(hay) - f0
            if rng.random() < 0.8 and len(hay) > 4:
                want = math.exp(rng.uniform(math.log(G.POSE_MIN_DISTANCE), math.log(MAX_POS - L)))
                gap = max(0, int(want) - d0)
                if gap:
                    pos[int(rng.integers(f1, len(hay) + 1)):] += gap
                room = MAX_POS - L - gap
                if room > 0 and f0 >= 2 and rng.random() < 0.5:
                    pos[int(rng.integers(2, f0 + 1)):] += int(rng.integers(0, room + 1))
        if info is not None:
            info["task"] = str(task)
            info["answered"] = answered
            info["decoys"] = len(decoys)
            info["distance"] = int(pos[len(hay)] - pos[fact_span[0]])
        return ids, tgt, pos

    def batch(self, seed: int, step: int, L: int, n: int):
        rng = np.random.default_rng([seed, step])
        out = [self.sample(rng, L) for _ in range(n)]
        return tuple(np.stack(x) for x in zip(*out))


def distance_histogram(data: TrainData, seed: int, steps: int, n: int = 3000, curriculum=CURRICULUM) -> dict:
    """Share of training sequences by the position-id distance from the asked fact to the
    question, per decade, over steps drawn uniformly from the run (so over the curriculum)."""
    rng = np.random.default_rng([seed, 10**9 + 1])
    edges = [0, 10, 100, 1_000, 10_000, 100_000, 1_000_000, MAX_POS]
    counts = [0] * (len(edges) - 1)
    info: dict = {}
    for _ in range(n):
        data.sample(rng, length_at(int(rng.integers(steps)), steps, curriculum), info)
        k = int(np.searchsorted(edges, info["distance"], side="right")) - 1
        counts[min(k, len(counts) - 1)] += 1
    return {f"[{edges[i]},{edges[i + 1]})": round(c / n, 3) for i, c in enumerate(counts)}


def length_at(step: int, steps: int, curriculum=CURRICULUM) -> int:
    acc = 0.0
    for L, frac in curriculum:
        acc += frac
        if step < acc * steps:
            return L
    return curriculum[-1][0]


def parse_curriculum(text: str) -> list[tuple[int, float]]:
    """"256:0.1,4096:0.9" -> [(256, 0.1), (4096, 0.9)]; the shares must add up to 1."""
    out = [(int(L), float(f)) for L, f in (part.split(":") for part in text.split(","))]
    if abs(sum(f for _, f in out) - 1.0) > 1e-6 or any(L < 64 or f <= 0 for L, f in out):
        raise SystemExit(f"--curriculum {text!r}: lengths >= 64 with positive shares adding up to 1")
    return out
