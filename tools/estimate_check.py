"""Predicts a prefill's time, runs it, and compares (docs/engine.md, *Prefill time*).

A fresh Folio home first prefills a short collection, which leaves the cost fitted to its chunks
in the library; then a long collection is staged (`--dry-run`: the staging sheet's prediction)
and prefilled with `--json`, whose stderr carries one progress line per chunk with its ETA. The
table says, for the staging prediction and for the ETA at points of the first layer and after
it, the total it implies (elapsed + ETA) against the run's real total:

    python3 tools/estimate_check.py --folio target/release/folio --length 20000

Prints the table and one JSON line with the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
# Points of the run whose ETA is checked: (share of the first layer, label), then layer ends.
FIRST_LAYER_POINTS = [(0.1, "layer 1, 10%"), (0.25, "layer 1, 25%"), (0.5, "layer 1, 50%"), (1.0, "layer 1 done")]


def collection(model: str, length: int, seed: int, out: Path) -> Path:
    subprocess.run(
        [sys.executable, str(TOOLS / "demo_collection.py"), model, "--length", str(length), "--seed", str(seed),
         "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL)
    return out / "docs"


def folio(binary: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *args], env=env, capture_output=True, text=True, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folio", required=True, help="the folio binary")
    ap.add_argument("--model", default=str(TOOLS.parent / "assets/models/demo"))
    ap.add_argument("--seed-length", type=int, default=4000, help="tokens of the first (fitting) prefill")
    ap.add_argument("--length", type=int, default=20000, help="tokens of the predicted prefill")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, FOLIO_HOME=str(tmp / "home"))
        common = ["--model", a.model, "--device", a.device]
        seed_docs = collection(a.model, a.seed_length, 1, tmp / "seed")
        folio(a.folio, env, "prefill", *common, "--docs", str(seed_docs), "--out", str(tmp / "seed.folio"), "--json")
        docs = collection(a.model, a.length, 2, tmp / "big")
        out = str(tmp / "big.folio")
        staged = json.loads(folio(a.folio, env, "prefill", *common, "--docs", str(docs), "--out", out, "--dry-run", "--json").stdout)
        predicted = staged["estimate"]["predicted_seconds"]
        tokens = staged["tokens"]

        started = time.monotonic()
        run = subprocess.Popen(
            [a.folio, "prefill", *common, "--docs", str(docs), "--out", out, "--json"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: list[tuple[float, dict]] = []
        for line in run.stderr:
            if line.startswith('{"progress"'):
                seen.append((time.monotonic() - started, json.loads(line)["progress"]))
        report = json.loads(run.stdout.read())["report"]
        if run.wait() != 0:
            raise SystemExit("the prefill failed")
        total = time.monotonic() - started

    rows = [("staging sheet", 0.0, predicted)]
    for share, label in FIRST_LAYER_POINTS:
        at = next(((t, p) for t, p in seen if p["layer"] == 0 and p["layer_tokens"] >= share * p["tokens"]), None)
        if at and at[1]["eta_s"] is not None:
            rows.append((label, at[0], at[0] + at[1]["eta_s"]))
    for t, p in seen:
        if p["layer"] > 0 and p["layer_tokens"] == p["tokens"] and p["eta_s"] is not None:
            rows.append((f"layer {p['layer'] + 1} done", t, t + p["eta_s"]))
    print(f"{tokens} tokens, {report['layers']} layers; real total {total:.1f} s "
          f"(the prefill's own {report['seconds']:.1f} s)")
    print(f"{'when':<16} {'at s':>8} {'says total s':>13} {'error':>8}")
    for label, at, says in rows:
        err = "" if says is None else f"{100 * (says / total - 1):+.0f}%"
        print(f"{label:<16} {at:>8.1f} {says if says is not None else float('nan'):>13.1f} {err:>8}")
    print(json.dumps({"tokens": tokens, "layers": report["layers"], "total_s": round(total, 2),
                      "rows": [{"when": l, "at_s": round(t, 2), "says_total_s": s and round(s, 2)} for l, t, s in rows]}))


if __name__ == "__main__":
    main()
