"""Writes a demo-model document collection to a folder: the haystack of one needle prompt
(tools/demo_prompts.py) as one text file per document, plus the question and expected answer.
It is the fixture context of docs/quality.md's attention harness:

    python3 tools/demo_collection.py assets/models/demo --length 8192 --depth 0.5 --seed 7 --out /tmp/coll
    folio prefill --model assets/models/demo --docs /tmp/coll/docs --out /tmp/coll/ctx.folio
    folio eval attention --context /tmp/coll/ctx.folio --question "$(cat /tmp/coll/question.txt)"
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from demo_prompts import load, make_prompt

DOC_MARK = "<|doc|> title : "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    spec, tok = load(a.model_dir)
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    p = make_prompt(spec, count, "needle", a.length, a.depth, random.Random(a.seed), None, False)
    docs_text = next(m["content"] for m in p["messages"] if DOC_MARK in m["content"])
    out = Path(a.out)
    (out / "docs").mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(d for d in docs_text.split(DOC_MARK) if d.strip()):
        title, _, body = doc.partition(" .\n")
        name = f"{i:03d}_{title.strip().replace(' ', '_')}.txt"
        (out / "docs" / name).write_text(body.strip() + "\n")
    question = p["messages"][-1]["content"]
    (out / "question.txt").write_text(question + "\n")
    print(json.dumps({"question": question, "answer": p["answer"], "documents": i + 1}))


if __name__ == "__main__":
    main()
