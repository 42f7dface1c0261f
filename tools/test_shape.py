#!/usr/bin/env python3
"""tools/shape.py against small crates written here: it must find what it claims to find.

A cycle between two sibling files, an upward import into a module's insides, one through the
front door (a re-export, which is fine), a child naming its parent's items (fine), a long
function, and a TypeScript import cycle. Run by scripts/test.sh before shape.py itself.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shape  # noqa: E402

FILES = {
    "src/lib.rs": "//! A test crate.\nmod a;\nmod b;\nmod deep;\nmod front;\npub use a::A;\n",
    # a <-> b: a cycle between siblings.
    "src/a.rs": "use crate::b::B;\npub struct A;\npub fn f(_: B) {}\n",
    "src/b.rs": "use crate::a::A;\npub struct B;\npub fn g(_: A) {}\n",
    # deep/inner.rs is deep's insides; front re-exports it.
    "src/deep/mod.rs": "mod inner;\npub use inner::Inner;\npub fn helper() {}\n",
    "src/deep/inner.rs": "use super::helper;\npub struct Inner;\nfn h() { helper() }\n",
    # front.rs reaches into deep's insides once (upward) and through its front door once (fine).
    "src/front.rs": "use crate::deep::inner::Inner;\nuse crate::deep::Inner as Again;\npub fn k(_: Inner, _: Again) {}\n",
}


def write(root: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main() -> int:
    failures = []
    with tempfile.TemporaryDirectory() as root:
        write(root, FILES)
        crate = shape.Crate(os.path.join(root, "src/lib.rs"), "t")
        shape.collect_reexports(crate)
        rel = lambda p: os.path.relpath(p, root)  # noqa: E731
        upward, edges = shape.crate_findings(crate, rel)
        found = [sorted(rel(f) for f in comp) for comp in shape.cycles(edges)]
        if found != [["src/a.rs", "src/b.rs"]]:
            failures.append(f"cycles: expected a <-> b only, got {found}")
        if upward != ["upward src/front.rs -> deep::inner"]:
            failures.append(f"upward: expected front -> deep::inner only, got {upward}")
    body = "fn long() {\n" + "    let x = 1;\n" * (shape.MAX_FN_LINES) + "}\nfn short() {}\n"
    lengths = {name: n for name, _, n in shape.long_functions(shape.blank_rust(body))}
    if lengths.get("long") != shape.MAX_FN_LINES + 2 or lengths.get("short") != 1:
        failures.append(f"function lengths: got {lengths}")
    blanked = shape.blank_rust('let s = "use crate::a::A; {"; // use crate::b::B;\nlet c = \'{\';')
    if "use" in blanked or "{" in blanked:
        failures.append(f"strings, comments and chars must be blanked: {blanked!r}")
    for f in failures:
        print("test_shape: FAILED " + f)
    print(f"test_shape: {4 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
