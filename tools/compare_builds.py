#!/usr/bin/env python3
"""Two builds' figures side by side: the JSON that `tools/gpu-smoke.sh compare` wrote for the
build before a change and the one after (`before-*.json*`, `after-*.json*` in one folder).

Why: a refactor that moves code (issue #43's crates, the KV folder, the method kernels) must
leave behaviour and speed as they were; the same commands from both builds, run on the same
machine in one sitting, say whether it did. Prints, per measured figure, both values and
after ÷ before, and each build's test results.

    python3 tools/compare_builds.py DIR
"""

from __future__ import annotations

import json
import os
import sys


def lines(path: str) -> list[dict]:
    """The JSON documents of a file of JSON lines (other lines, e.g. warnings, skipped)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                out.append(json.loads(line))
    return out


def figures(folder: str, side: str) -> dict[str, float]:
    """Name → value of every figure a side's benchmarks printed."""
    got: dict[str, float] = {}
    for doc in lines(os.path.join(folder, f"{side}-kernels.json")):
        for row in doc.get("kernels", []):
            got[f"kernels: {row['kernel']} (µs)"] = row["seconds"] * 1e6
    for doc in lines(os.path.join(folder, f"{side}-shape.jsonl")):
        m = doc.get("method")
        for key in ("decode_ms_mean", "decode_ms_median", "decode_ms_p90", "first_step_s"):
            if key in doc:
                got[f"shape {doc.get('context')}: {m} {key}"] = doc[key]
    for doc in lines(os.path.join(folder, f"{side}-prefill.json")):
        rows = doc.get("rows", [doc])
        for row in rows:
            if "tokens_per_s" in row:
                got[f"prefill cpu {row.get('tokens')}: tokens/s"] = row["tokens_per_s"]
    return got


def tests(folder: str, side: str) -> list[str]:
    path = os.path.join(folder, f"{side}-tests.log")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [line.rstrip() for line in f if line.startswith(("== ", "test result"))]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    folder = sys.argv[1]
    before, after = figures(folder, "before"), figures(folder, "after")
    if not before or not after:
        print(f"compare: no figures for {'before' if not before else 'after'} in {folder}", file=sys.stderr)
        return 1
    width = max(len(k) for k in before | after)
    print(f"{'figure':<{width}} {'before':>12} {'after':>12} {'after/before':>13}")
    for key in sorted(before | after):
        b, a = before.get(key), after.get(key)
        ratio = f"{a / b:13.3f}" if a is not None and b else f"{'-':>13}"
        fmt = lambda x: f"{x:12.3f}" if x is not None else f"{'-':>12}"  # noqa: E731
        print(f"{key:<{width}} {fmt(b)} {fmt(a)} {ratio}")
    for side in ("before", "after"):
        print(f"\n{side}: tests")
        for line in tests(folder, side):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
