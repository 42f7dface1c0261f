"""The yardstick model's language and its RULER-style tasks (issue #49).

The yardstick is a deeper sibling of the demo model (docs/yardstick.md): the demo's vocabulary,
filler grammar and facts (tools/demo_grammar.py) plus the words and sentence forms of seven
tasks that RULER (Hsieh et al. 2024) uses to tell long-context methods apart, each put into the
demo's fact grammar so that every answer is checked exactly:

* **multi_key** — one fact among many with keys that share a word with it (RULER MK-NIAH).
* **multi_value** — one key with several values, all asked; the answer lists them in document
  order (MV-NIAH), so the model must find every one and know when to stop.
* **near_dup** — the asked fact among near-duplicates: the same key with another relation, the
  same relation with a key sharing a word, values sharing a run of digits with the answer.
* **deep_chain** — variable tracking with 4+ hops (the demo's chain trained to 6 hops).
* **count** — "how many times was the {key} seen ?": every sighting must be read (aggregation).
* **frequent** — "which animal was fed most often ?": the most frequent word of a scattered list
  (RULER's common-word extraction, top 1).
* **two_hop** — a question answered from two passages half the documents apart: a key's friend,
  then that friend's fact, found while the answer is written.
* **recite** — a marked passage of filler sentences (>= 64 tokens at eval) written out in full:
  the task where a sparse decode must keep finding the next rows at every step.

Each task draw is text: the facts (with where they must go), the question, the answer, its
prefilled opening words and the values a partial score counts. Training (tools/demo_data.py)
turns draws into ids; `folio eval` builds the same forms in Rust from eval_spec.json's `ruler`
section, which `eval_spec()` here writes from the constants below (one source of truth).
"""

from __future__ import annotations

import demo_grammar as G

# --------------------------------------------------------------------------------------
# Sentence forms. New words are appended to the demo's vocabulary (ids of the demo's words do
# not move) and are disjoint from the filler, so a fact's words mark it.
# --------------------------------------------------------------------------------------
MV_QUESTION = "what are all the {relation} values of {key} ?"
SIGHTING = "{name} saw the {key} ."
COUNT_QUESTION = "how many times was the {key} seen ?"
COUNT_ANSWER = "the {key} was seen {count} times ."
COUNT_ANSWER_PREFIX = "the {key} was seen"
FEEDING = "{name} fed a {animal} ."
FREQUENT_QUESTION = "which animal was fed most often ?"
FREQUENT_ANSWER = "the {animal} was fed most often ."
FREQUENT_ANSWER_PREFIX = "the"
FRIEND_LINK = "the friend of {key} is {key2} ."
TWO_HOP_QUESTION = "what is the {relation} of the friend of {key} ?"
TWO_HOP_ANSWER_PREFIX = "the friend of {key} is"
PASSAGE_OPEN = "the {key} passage :"
PASSAGE_CLOSE = "end of the {key} passage ."
RECITE_QUESTION = "recite the {key} passage ."
RECITE_ANSWER_PREFIX = "the {key} passage :"

NEW_WORDS = ["saw", "seen", "times", "fed", "animal", "friend", "passage", "recite", "end"]

# Eval settings (the suite's fixed forms; training draws around them, see draw()).
EVAL = {
    "multi_key": {"distractors": 15},
    "multi_value": {"values": 4, "distractors": 3},
    "near_dup": {"same_key": 3, "same_relation": 4},
    "deep_chain": {"hops": 4, "distractors": 4},
    "count": {"min": 2, "max": 9, "other_keys": 3, "other_max": 4},
    "frequent": {"winner_min": 4, "winner_max": 8, "others": 4, "gap": 2},
    "two_hop": {"distractors": 3},
    "recite": {"min_tokens": 64, "max_tokens": 96},
}
TASKS = list(EVAL)
# The tasks draw() makes; deep_chain is the demo's chain task (demo_data's "var") to more hops.
DRAWN = [t for t in TASKS if t != "deep_chain"]

# The yardstick's shape (docs/yardstick.md): the demo's width per head, a real model's depth,
# and Qwen2.5-7B's grouping of 7 query heads per K/V head.
SHAPE = {"layers": 24, "hidden": 224, "heads": 7, "kv_heads": 1, "head_dim": 32, "intermediate": 672}

# The yardstick's data: the demo's last recipe (5-digit values, decoys, facts beside the pass
# key) with the suite's tasks beside the demo's four (shares of training sequences).
RECIPE = {"value_digits": (5, 5), "filler_numbers": True, "pose": "random_cuts", "prefill_answer_prefix": True,
          "decoys": True, "passkey_among_facts": True, "max_hops": 6,
          "tasks": {"passkey": 0.04, "kv": 0.12, "multi_doc": 0.08, "var": 0.12, "multi_key": 0.08,
                    "multi_value": 0.1, "near_dup": 0.08, "count": 0.1, "frequent": 0.08, "two_hop": 0.1,
                    "recite": 0.1}}
assert abs(sum(RECIPE["tasks"].values()) - 1.0) < 1e-9
RECIPES = {"yard1": RECIPE}


def vocabulary() -> list[str]:
    base = G.vocabulary()
    clash = set(NEW_WORDS) & set(base)
    assert not clash, f"yardstick words already in the demo vocabulary: {sorted(clash)}"
    return base + NEW_WORDS


def check_disjoint() -> None:
    """The suite's marker words never occur in filler sentences or titles."""
    filler = {w for v in G.FILLER_SLOTS.values() for p in v for w in p.split()}
    for t in G.FILLER_TEMPLATES + G.TITLE_TEMPLATES:
        filler.update(w for w in t.split() if not w.startswith("{"))
    clash = filler & set(NEW_WORDS)
    assert not clash, f"yardstick words also in the filler: {sorted(clash)}"


# The demo recipe whose prompt settings (value digits, filler numbers, prefilled prefix) a
# yardstick recipe shares, for its eval_spec.
SPEC_BASE = {"yard1": "run6"}


def eval_spec(recipe: str = "yard1") -> dict:
    """The eval_spec of the data `recipe` makes (a yardstick recipe's demo base, or a demo
    recipe trained on the yardstick's shape) with version 2's `ruler` section: each task's
    forms and the eval settings, which `folio eval` reads."""
    spec = G.eval_spec(SPEC_BASE.get(recipe, recipe))
    spec["version"] = 2
    spec["description"] = ("Prompt distribution of Folio's yardstick model: the demo's, plus the RULER-style suite "
                           "of docs/yardstick.md.")
    spec["tasks"]["variable_tracking"]["hops"] = 2
    e = EVAL
    spec["ruler"] = {
        "fact": G.KV_FACT, "relations": G.RELATIONS, "question": G.KV_QUESTION, "answer": G.KV_ANSWER,
        "answer_prefix": G.KV_ANSWER_PREFIX,
        "animals": G.KEY_NOUNS, "names": G.FILLER_SLOTS["name"],
        "multi_key": {**e["multi_key"]},
        "multi_value": {"question": MV_QUESTION, **e["multi_value"]},
        "near_dup": {**e["near_dup"]},
        "deep_chain": {**e["deep_chain"]},
        "count": {"sighting": SIGHTING, "question": COUNT_QUESTION, "answer": COUNT_ANSWER,
                  "answer_prefix": COUNT_ANSWER_PREFIX, **e["count"]},
        "frequent": {"feeding": FEEDING, "question": FREQUENT_QUESTION, "answer": FREQUENT_ANSWER,
                     "answer_prefix": FREQUENT_ANSWER_PREFIX, **e["frequent"]},
        "two_hop": {"link": FRIEND_LINK, "question": TWO_HOP_QUESTION, "answer_prefix": TWO_HOP_ANSWER_PREFIX,
                    **e["two_hop"]},
        "recite": {"open": PASSAGE_OPEN, "close": PASSAGE_CLOSE, "question": RECITE_QUESTION,
                   "answer_prefix": RECITE_ANSWER_PREFIX, **e["recite"]},
    }
    return spec


# --------------------------------------------------------------------------------------
# Draws. `d` is demo_data.TrainData (value(), similar_value(), keys(), sentence_text(), ids());
# `rng` numpy's Generator. A fact's place is None (anywhere), "A"/"B" (two different
# documents) or ("ordered", group) (anywhere, but the group's facts in list order).
# --------------------------------------------------------------------------------------
def _pick(rng, items):
    return items[int(rng.integers(len(items)))]


def _kv(relation, key, value):
    return G.KV_FACT.format(relation=relation, key=key, value=value)


def _confusable(key: str, rng, d, n: int) -> list[str]:
    """`n` distinct keys other than `key`, each sharing its adjective or its noun."""
    adj, noun = key.split()
    out: list[str] = []
    while len(out) < n:
        k = f"{adj} {_pick(rng, G.KEY_NOUNS)}" if rng.random() < 0.5 else f"{_pick(rng, G.KEY_ADJS)} {noun}"
        if k != key and k not in out:
            out.append(k)
    return out


def draw(task: str, rng, d, short: bool) -> dict:
    """One training draw of `task`: {facts: [(text, place)], turns: [(q, a)], answered: [...]}.
    Counts are drawn around the eval settings (EVAL), smaller in short sequences."""
    rel = _pick(rng, G.RELATIONS)
    if task == "multi_key":
        n = int(rng.integers(4, 9 if short else 24))
        key = d.keys(rng, 1, False)[0]
        keys = [key] + _confusable(key, rng, d, n - 1)
        v = d.value(rng)
        facts = [(_kv(rel, key, v), None)]
        facts += [(_kv(_pick(rng, G.RELATIONS), k, d.value(rng)), None) for k in keys[1:]]
        return {"facts": facts, "turns": [(G.KV_QUESTION.format(relation=rel, key=key), _kv(rel, key, v))],
                "answered": [v]}
    if task == "multi_value":
        m = int(rng.integers(2, 6))
        key = d.keys(rng, 1, False)[0]
        vals = [d.value(rng) for _ in range(m)]
        facts = [(_kv(rel, key, v), ("ordered", 0)) for v in vals]
        for k in _confusable(key, rng, d, int(rng.integers(0, 5))):
            facts.append((_kv(rel if rng.random() < 0.5 else _pick(rng, G.RELATIONS), k, d.value(rng)), None))
        answer = " ".join(_kv(rel, key, v) for v in vals)
        return {"facts": facts, "turns": [(MV_QUESTION.format(relation=rel, key=key), answer)], "answered": vals}
    if task == "near_dup":
        key = d.keys(rng, 1, False)[0]
        v = d.value(rng)
        facts = [(_kv(rel, key, v), None)]
        for r in [r for r in G.RELATIONS if r != rel][: int(rng.integers(1, 4))]:
            facts.append((_kv(r, key, d.similar_value(rng, v)), None))
        for k in _confusable(key, rng, d, int(rng.integers(1, 5))):
            facts.append((_kv(rel, k, d.similar_value(rng, v)), None))
        return {"facts": facts, "turns": [(G.KV_QUESTION.format(relation=rel, key=key), _kv(rel, key, v))],
                "answered": [v]}
    if task == "count":
        key = d.keys(rng, 1, False)[0]
        n = int(rng.integers(1, 10))
        facts = [(SIGHTING.format(name=_pick(rng, G.FILLER_SLOTS["name"]), key=key), None) for _ in range(n)]
        for k in _confusable(key, rng, d, int(rng.integers(0, 4))):
            for _ in range(int(rng.integers(1, 5))):
                facts.append((SIGHTING.format(name=_pick(rng, G.FILLER_SLOTS["name"]), key=k), None))
        return {"facts": facts, "turns": [(COUNT_QUESTION.format(key=key), COUNT_ANSWER.format(key=key, count=n))],
                "answered": [str(n)]}
    if task == "frequent":
        m = int(rng.integers(3, 9))
        animals = [G.KEY_NOUNS[i] for i in rng.choice(len(G.KEY_NOUNS), int(rng.integers(2, 6)), replace=False)]
        facts = []
        for i, a in enumerate(animals):
            for _ in range(m if i == 0 else int(rng.integers(1, m - 1))):
                facts.append((FEEDING.format(name=_pick(rng, G.FILLER_SLOTS["name"]), animal=a), None))
        return {"facts": facts, "turns": [(FREQUENT_QUESTION, FREQUENT_ANSWER.format(animal=animals[0]))],
                "answered": [animals[0]]}
    if task == "two_hop":
        keys = d.keys(rng, 2 + 2 * int(rng.integers(0, 4)), rng.random() < 0.5)
        v = d.value(rng)
        facts = [(FRIEND_LINK.format(key=keys[0], key2=keys[1]), "A"), (_kv(rel, keys[1], v), "B")]
        for j in range(2, len(keys), 2):  # other friendships and their facts
            facts.append((FRIEND_LINK.format(key=keys[j], key2=keys[j + 1]), None))
            facts.append((_kv(_pick(rng, G.RELATIONS), keys[j + 1], d.value(rng)), None))
        answer = FRIEND_LINK.format(key=keys[0], key2=keys[1]) + " " + _kv(rel, keys[1], v)
        return {"facts": facts, "turns": [(TWO_HOP_QUESTION.format(relation=rel, key=keys[0]), answer)],
                "answered": [keys[1], v]}
    if task == "recite":
        key = d.keys(rng, 1, False)[0]
        want = int(rng.integers(12, 48 if short else 100))
        sents, n = [], 0
        while n < want:
            s = d.sentence_text(rng)
            sents.append(s)
            n += len(d.ids(s))
        passage = " ".join([PASSAGE_OPEN.format(key=key)] + sents + [PASSAGE_CLOSE.format(key=key)])
        return {"facts": [(passage, None)], "turns": [(RECITE_QUESTION.format(key=key), passage)],
                "answered": sents}
    raise ValueError(f"unknown yardstick task {task!r}")
