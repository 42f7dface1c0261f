#!/usr/bin/env python3
"""Greedy answers of transformers on prompts that Folio saved, to tell a model's miss from an
engine's (GPU machine: PyTorch + transformers).

`folio eval needle --out DIR` writes the token ids of every prompt it got wrong to
DIR/misses/<length>-<depth>-<sample>.u32 (little-endian u32) with a .json beside it (expected
and Folio's output). This decodes each such prompt greedily with transformers (bf16, sdpa flash
kernels, the same setup as tools/train_demo.py's eval) and prints both answers:

    python3 tools/demo_check_ids.py assets/models/demo DIR/misses

Same answer in both: the model misses this prompt. Transformers right and Folio wrong: look at
the engine (compare logits layer by layer on these ids).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("misses", help="folder of <name>.u32 prompts with <name>.json beside each")
    a = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaForCausalLM

    md = Path(a.model_dir)
    tok = Tokenizer.from_file(str(md / "tokenizer.json"))
    eos = json.loads((md / "generation_config.json").read_text())["eos_token_id"]
    stop = set(eos if isinstance(eos, list) else [eos])
    model = LlamaForCausalLM.from_pretrained(md, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    files = sorted(Path(a.misses).glob("*.u32"))
    if not files:
        sys.exit(f"no .u32 prompts in {a.misses}")
    same = right = 0
    for f in files:
        ids = np.fromfile(f, dtype="<u4").astype(np.int64).tolist()
        meta = json.loads(f.with_suffix(".json").read_text())
        # Folio's cap: the expected answer's tokens and EXTRA_ANSWER_TOKENS (4) more
        max_new = len(tok.encode(meta["expected"], add_special_tokens=False).ids) + 4
        out: list[int] = []
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            o = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True, logits_to_keep=1)
            past, nxt = o.past_key_values, int(o.logits[0, -1].argmax())
            while nxt not in stop and len(out) < max_new:
                out.append(nxt)
                o = model(input_ids=torch.tensor([[nxt]], device="cuda"), past_key_values=past, use_cache=True)
                past, nxt = o.past_key_values, int(o.logits[0, -1].argmax())
        text = tok.decode(out)
        same += text.strip() == meta["output"].strip()
        ok = answer_key(text) == answer_key(meta["expected"])
        right += ok
        print(f"{f.name}: {len(ids)} tokens; expected {meta['expected']!r}; folio {meta['output']!r}; "
              f"transformers {text!r} ({'right' if ok else 'wrong'})")
    print(f"{len(files)} prompts Folio missed: transformers answers {same} as Folio did, {right} right")


def answer_key(text: str) -> str:
    """The answer up to its first '.', spaces removed: "8 5 1 7 5 ." and "85175" agree."""
    return text.split(".")[0].replace(" ", "")


if __name__ == "__main__":
    main()
