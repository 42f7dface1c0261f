#!/usr/bin/env python3
"""The code's measured shape, and a ratchet that keeps it from growing worse.

Why this exists: the architecture rules (docs/architecture.md, "Rules") are only kept if
something measures them on every run. This script measures, per crate and in ui/src:

  cycles    import cycles between files (a strongly connected group of two or more files); a
            child's use of its ancestors' items is no edge (a module folder is one unit, its
            mod.rs the face), an import between any other two files is;
  upward    imports that reach into a module that is not one's own, a child, a sibling or a
            sibling of an ancestor: `crate::a::b::X` from `c::d` reaches inside `a` (its
            insides are `a`'s business; `a` re-exports what others may use);
  long      source files over MAX_FILE_LINES lines (Rust, CUDA, TypeScript, Svelte, Python);
  fns       Rust functions over MAX_FN_LINES lines;
  docs      crates whose lib.rs does not open with a `//!` doc stating the crate's job, and
            source files under a crate's src/ that docs/architecture.md does not name (and
            paths it names that do not exist).

Every finding is a string; `tools/shape-baseline.txt` lists the findings that are known and
being worked off. The run fails when a finding is not in the baseline (the shape got worse)
or a baseline line is no longer found (the shape got better: delete the line, so that it
cannot come back unnoticed). `--write-baseline` rewrites the file from the current findings.

Resolution is by the paths as written, read with a small Rust lexer: `use` trees, inline
`crate::`/`super::`/`self::` paths and paths through a declared child module; `pub use`
re-exports are followed to the file that defines the item, so a crate root that re-exports
does not put every file in one cycle. Macros and `#[path]` attributes are not followed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES = 700
MAX_FN_LINES = 120


def workspace_members() -> list[str]:
    """The crates of the workspace, as Cargo.toml lists them (a new crate is measured at once)."""
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        m = re.search(r"^members\s*=\s*\[([^\]]*)\]", f.read(), re.M)
    return re.findall(r'"([^"]+)"', m.group(1)) if m else []


CRATES = workspace_members()
SOURCE_EXTS = (".rs", ".cu", ".cuh", ".ts", ".svelte", ".py")
# third_party: published crates with a patch of ours (third_party/README.md), not our code.
SKIP_DIRS = {"target", "node_modules", ".git", "dist", "gen", "results", "fixtures", "third_party"}
BASELINE = os.path.join(ROOT, "tools", "shape-baseline.txt")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# ---------------------------------------------------------------------------------------------
# A Rust lexer good enough to find code: comments and literals blanked, line numbers kept.


def blank_rust(text: str) -> str:
    """Text with comments, strings and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"[A-Za-z0-9_]", text[i - 1 : i] or " "):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'\n])'", text[i:])
            if m:  # a char literal; otherwise a lifetime
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::d@e, f::*}` -> [['a','b'], ['a','c','d@e'], ['a','f','*']] (aliases marked `@`)."""
    tree = re.sub(r"\s+", "", tree)
    results: list[list[str]] = []

    def walk(s: str, prefix: list[str]) -> None:
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        for part in parts:
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0:
                head = part[:brace].rstrip(":")
                walk(part[brace + 1 : part.rfind("}")], prefix + ([p for p in head.split("::") if p]))
            else:
                results.append(prefix + part.split("::"))

    walk(tree, [])
    return results


USE_RE = re.compile(r"\b(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]*);")


def uses(code: str) -> list[tuple[int, bool, list[str], str | None]]:
    """(offset, is_pub, path, alias) of every path of every `use` in blanked code."""
    found = []
    for m in USE_RE.finditer(code):
        tree = m.group(2)
        # Mark aliases so that removing whitespace keeps them apart.
        tree = re.sub(r"\s+as\s+(" + IDENT + r")", r"@\1", tree)
        for path in parse_use_tree(tree):
            alias = None
            if path and "@" in path[-1]:
                path[-1], alias = path[-1].split("@", 1)
            found.append((m.start(), bool(m.group(1)), [p for p in path if p], alias))
    return found


# ---------------------------------------------------------------------------------------------
# Crates as module trees.


@dataclass
class Module:
    path: tuple[str, ...]  # module path from the crate root
    file: str  # the file that holds it (inline modules share their file)
    children: dict[str, "Module"] = field(default_factory=dict)
    reexports: dict[str, list[str]] = field(default_factory=dict)  # name -> absolute path
    external: set[str] = field(default_factory=set)  # names re-exported from other crates
    globs: list[list[str]] = field(default_factory=list)  # `pub use x::*` sources (absolute)


MOD_RE = re.compile(r"(?:^|[;{}\]\s])(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*([;{])")


def closing(code: str, open_at: int) -> int:
    """Where the brace opened at `open_at` closes (the end of the code if it never does)."""
    depth, j = 0, open_at
    while j < len(code):
        depth += code[j] == "{"
        depth -= code[j] == "}"
        if depth == 0:
            break
        j += 1
    return j


def inline_spans(code: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of every inline `mod name { ... }` in a file's blanked code."""
    spans = []
    for m in MOD_RE.finditer(code):
        if m.group(2) == "{":
            open_at = m.end() - 1
            spans.append((open_at, closing(code, open_at), m.group(1)))
    return spans


class Crate:
    def __init__(self, root_file: str, name: str):
        self.name = name
        self.files: dict[str, str] = {}  # file -> blanked code
        self.raw: dict[str, str] = {}
        self.file_module: dict[str, Module] = {}
        self.root = self._load(root_file, ())

    def _load(self, file: str, path: tuple[str, ...]) -> Module:
        with open(file, encoding="utf-8") as f:
            raw = f.read()
        code = blank_rust(raw)
        self.raw[file], self.files[file] = raw, code
        module = Module(path, file)
        self.file_module[file] = module
        spans = inline_spans(code)
        for m in MOD_RE.finditer(code):
            name = m.group(1)
            if m.group(2) == "{":
                inner = self._inline_path(spans, m.start(1), path)
                module_at(module, inner[len(path) :] + (name,), file)
                continue
            inner = self._inline_path(spans, m.start(1), path)
            if inner != path:
                continue  # a file module declared inside an inline module: rare, not followed
            base = os.path.dirname(file)
            stem = os.path.basename(file)[:-3]
            if stem not in ("lib", "main", "mod") and not self._is_root(file):
                base = os.path.join(base, stem)
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    module.children[name] = self._load(cand, path + (name,))
                    break
        return module

    def _is_root(self, file: str) -> bool:
        return not self.file_module or next(iter(self.file_module)) == file

    @staticmethod
    def _inline_path(spans, offset, path):
        inner = tuple(name for (s, e, name) in spans if s < offset < e)
        return path + inner

    def modules(self):
        stack = [self.root]
        while stack:
            m = stack.pop()
            yield m
            stack.extend(m.children.values())

    def find(self, path: tuple[str, ...]) -> Module | None:
        m = self.root
        for seg in path:
            m = m.children.get(seg)
            if m is None:
                return None
        return m


def module_at(parent: Module, rel: tuple[str, ...], file: str) -> Module:
    m = parent
    for seg in rel:
        if seg not in m.children:
            m.children[seg] = Module(m.path + (seg,), file)
        m = m.children[seg]
    return m


def absolute(crate: Crate, here: tuple[str, ...], path: list[str]) -> list[str] | None:
    """A written path made absolute from module `here`; None for another crate's path."""
    if not path:
        return None
    head = path[0]
    if head == "crate":
        return path[1:]
    if head in ("self", "super"):
        cur = list(here)
        rest = list(path)
        while rest and rest[0] in ("self", "super"):
            if rest.pop(0) == "super":
                if not cur:
                    return None
                cur.pop()
        return cur + rest
    mod = crate.find(here)
    if mod is not None and head in mod.children:
        return list(here) + path
    return None


def collect_reexports(crate: Crate) -> None:
    for module in crate.modules():
        if module.file not in crate.files or crate.file_module.get(module.file) is not module:
            continue
        for _, is_pub, path, alias in uses(crate.files[module.file]):
            if not is_pub:
                continue
            ab = absolute(crate, module.path, path)
            if ab is None:
                if path and path[-1] != "*":
                    module.external.add(alias or path[-1])
                continue
            if ab[-1] == "*":
                module.globs.append(ab[:-1])
            else:
                module.reexports[alias or ab[-1]] = ab


def resolve(crate: Crate, ab: list[str], seen: int = 0) -> tuple[str | None, tuple[str, ...]]:
    """(file that defines the item, module reached by the written segments)."""
    m = crate.root
    i = 0
    while i < len(ab) and ab[i] in m.children:
        m = m.children[ab[i]]
        i += 1
    written = m.path
    if i >= len(ab) or ab[i] == "*" or seen > 8:
        return m.file, written
    name = ab[i]
    if name in m.external:
        return None, written  # another crate's item, passed through: no file of this crate
    if name in m.reexports:
        target, _ = resolve(crate, m.reexports[name], seen + 1)
        return target or m.file, written
    for glob in m.globs:
        g = crate.find(tuple(glob))
        if g is not None and (name in g.reexports or defines(crate, g, name)):
            target, _ = resolve(crate, glob + [name], seen + 1)
            return target or m.file, written
    return m.file, written


def defines(crate: Crate, module: Module, name: str) -> bool:
    code = crate.files.get(module.file, "")
    return re.search(r"\b(?:struct|enum|fn|trait|type|const|static|union|macro_rules!)\s+" + re.escape(name) + r"\b", code) is not None


INLINE_PATH = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+|" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)")


def file_imports(crate: Crate, file: str) -> list[tuple[int, list[str], tuple[str, ...]]]:
    """(line, absolute path, module of the code) for each in-crate path a file writes."""
    code = crate.files[file]
    base = crate.file_module[file].path
    spans = inline_spans(code)
    use_spans = [(m.start(), m.end()) for m in USE_RE.finditer(code)]
    out = []

    def line_of(off: int) -> int:
        return code.count("\n", 0, off) + 1

    for off, _, path, _ in uses(code):
        here = Crate._inline_path(spans, off, base)
        ab = absolute(crate, here, path)
        if ab is not None:
            out.append((line_of(off), ab, here))
    for m in INLINE_PATH.finditer(code):
        if any(s <= m.start() < e for s, e in use_spans):
            continue
        path = [p.strip() for p in m.group(1).split("::")]
        here = Crate._inline_path(spans, m.start(), base)
        ab = absolute(crate, here, path)
        if ab is not None:
            out.append((line_of(m.start()), ab, here))
    return out


def is_test_module(path: tuple[str, ...]) -> bool:
    return bool(path) and path[-1] in ("tests", "test")


def crate_findings(crate: Crate, rel) -> tuple[list[str], dict[str, set[str]]]:
    findings: list[str] = []
    edges: dict[str, set[str]] = {f: set() for f in crate.files}
    for file in crate.files:
        for line, ab, here in file_imports(crate, file):
            if any(is_test_module(here[: k + 1]) for k in range(len(here))):
                continue  # a file's own tests may reach anywhere in the crate
            target, written = resolve(crate, ab)
            # A module's children are its own: a child that names its ancestors' items adds no
            # edge (the parent file is the unit's face), one between any other files does.
            owner = crate.file_module[target].path if target in crate.file_module else ()
            if target and target != file and here[: len(owner)] != owner:
                edges[file].add(target)
            # Upward: the written target must be one's own subtree, or the child of a common
            # ancestor (a sibling of oneself or of an ancestor).
            if written[: len(here)] == here:
                continue
            common = 0
            while common < min(len(here), len(written)) and here[common] == written[common]:
                common += 1
            if len(written) - common > 1:
                findings.append(f"upward {rel(file)} -> {'::'.join(written)}")
    return sorted(set(findings)), edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more nodes (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# ---------------------------------------------------------------------------------------------
# Functions and files.

FN_RE = re.compile(r"\bfn\s+(" + IDENT + r")")


def long_functions(code: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every Rust fn with a body."""
    out = []
    for m in FN_RE.finditer(code):
        j, depth = m.end(), 0
        while j < len(code):
            ch = code[j]
            if ch in "([<":
                depth += 1
            elif ch in ")]>" and depth:
                if ch == ">" and code[j - 1] == "-":
                    pass
                else:
                    depth -= 1
            elif ch == ";" and depth == 0:
                j = -1
                break
            elif ch == "{" and depth == 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        start_line = code.count("\n", 0, m.start()) + 1
        end_line = code.count("\n", 0, closing(code, j)) + 1
        out.append((m.group(1), start_line, end_line - start_line + 1))
    return out


def source_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(SOURCE_EXTS):
                yield os.path.join(dirpath, name)


# ---------------------------------------------------------------------------------------------
# The UI's TypeScript and Svelte imports.

TS_IMPORT = re.compile(
    r"""(?:import|export)\s[^;]*?from\s+['"](\.[^'"]+)['"]|import\s*\(?\s*['"](\.[^'"]+)['"]""", re.S
)


def ui_edges() -> dict[str, set[str]]:
    ui = os.path.join(ROOT, "ui", "src")
    edges: dict[str, set[str]] = {}
    for dirpath, dirnames, filenames in os.walk(ui):
        for name in filenames:
            if not name.endswith((".ts", ".svelte")):
                continue
            file = os.path.join(dirpath, name)
            with open(file, encoding="utf-8") as f:
                text = f.read()
            targets = set()
            for m in TS_IMPORT.finditer(text):
                spec = m.group(1) or m.group(2)
                base = os.path.normpath(os.path.join(dirpath, spec))
                for cand in (base, base + ".ts", base + ".svelte", os.path.join(base, "index.ts")):
                    if os.path.isfile(cand):
                        targets.add(cand)
                        break
            edges[file] = targets
    return edges


# ---------------------------------------------------------------------------------------------


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def crate_roots():
    for name in CRATES:
        src = os.path.join(ROOT, name, "src")
        for root in ("lib.rs", "main.rs"):
            f = os.path.join(src, root)
            if os.path.exists(f):
                yield name, f


def architecture_findings(crate_files: set[str]) -> list[str]:
    if not os.path.exists(ARCHITECTURE):
        return ["docs missing docs/architecture.md"]
    with open(ARCHITECTURE, encoding="utf-8") as f:
        text = f.read()
    named = set(re.findall(r"`([A-Za-z0-9_./-]+\.(?:rs|cu|ts|svelte))`", text))
    out = []
    for f in sorted(crate_files):
        if rel(f) not in named:
            out.append(f"docs architecture.md does not name {rel(f)}")
    top = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))}
    for n in sorted(named):
        # Paths from the repository's root (`models/src/kv.rs`); prose names files relative to
        # their crate too (`context/build.rs`), which are not checked.
        if n.split("/")[0] in top and not os.path.exists(os.path.join(ROOT, n)):
            out.append(f"docs architecture.md names {n}, which does not exist")
    return out


def measure() -> tuple[list[str], dict[str, int]]:
    findings: list[str] = []
    counts = {"crates": 0, "files": 0, "cycles": 0, "upward": 0, "long": 0, "fns": 0, "docs": 0}
    crate_files: set[str] = set()
    for name, root in crate_roots():
        crate = Crate(root, name)
        counts["crates"] += 1
        collect_reexports(crate)
        crate_files.update(crate.files)
        up, edges = crate_findings(crate, rel)
        findings += up
        counts["upward"] += len(up)
        for comp in cycles(edges):
            findings.append("cycle " + " <-> ".join(rel(f) for f in comp))
            counts["cycles"] += 1
        head = crate.raw[root].lstrip()
        if not head.startswith("//!"):
            findings.append(f"docs {rel(root)} does not open with a //! statement of the crate's job")
            counts["docs"] += 1
    for comp in cycles(ui_edges()):
        findings.append("cycle " + " <-> ".join(rel(f) for f in comp))
        counts["cycles"] += 1
    for file in source_files():
        counts["files"] += 1
        with open(file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines > MAX_FILE_LINES:
            findings.append(f"long {rel(file)} ({lines} lines)")
            counts["long"] += 1
        if file.endswith(".rs"):
            for fn, line, n in long_functions(blank_rust(text)):
                if n > MAX_FN_LINES:
                    findings.append(f"fn {rel(file)}::{fn} ({n} lines)")
                    counts["fns"] += 1
    # Generated declarations (ui/src/lib/bindings, from the Rust types) are named as a folder.
    ui_files = {
        f for f in ui_edges() if not f.endswith((".test.ts", ".d.ts")) and f"{os.sep}bindings{os.sep}" not in f
    }
    arch = architecture_findings(crate_files | ui_files)
    findings += arch
    counts["docs"] += len(arch)
    return findings, counts


def key(finding: str) -> str:
    """A finding without its measured size, so a long file that shrinks but stays long matches."""
    return re.sub(r" \(\d+ lines\)$", "", finding)


MODULE_NOTE_CHARS = 200


def module_note(file: str) -> str:
    """The first sentence of a file's `//!` docs, links unwrapped, cut at a word near
    MODULE_NOTE_CHARS: its line in docs/architecture.md's module tables."""
    with open(file, encoding="utf-8") as f:
        lines = []
        for line in f:
            if not line.startswith("//!"):
                if lines:
                    break
                continue
            lines.append(line[3:].strip())
    text = " ".join(x for x in lines if x)
    text = re.sub(r"\[`([^`]+)`\](\([^)]*\))?", r"`\1`", text)
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)
    m = re.search(r"[.!?](\s|$)", text)
    sentence = text[: m.start() + 1] if m else text
    if len(sentence) > MODULE_NOTE_CHARS:
        sentence = sentence[:MODULE_NOTE_CHARS].rsplit(" ", 1)[0] + " …"
    return sentence.replace("|", "\\|")


def module_tables() -> str:
    """docs/architecture.md's "Modules" tables of the crates, one per crate, from the tree."""
    out = []
    for name, root in crate_roots():
        crate = Crate(root, name)
        out.append(f"### {name}\n\n| module | its room |\n|---|---|")
        top = sorted(f for f in crate.files if os.path.dirname(f) == os.path.dirname(root))
        nested = sorted(f for f in crate.files if f not in top)
        for f in top + nested:
            out.append(f"| `{rel(f)}` | {module_note(f)} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-baseline", action="store_true", help="record today's findings as known")
    ap.add_argument("--list", action="store_true", help="print every finding")
    ap.add_argument("--modules", action="store_true", help="print docs/architecture.md's module tables")
    args = ap.parse_args()
    if args.modules:
        print(module_tables(), end="")
        return 0
    findings, counts = measure()
    print(
        "shape: {crates} crates, {files} source files; import cycles {cycles}, upward imports {upward}, "
        "files over {mf} lines {long}, functions over {mfn} lines {fns}, docs {docs}".format(
            mf=MAX_FILE_LINES, mfn=MAX_FN_LINES, **counts
        )
    )
    if args.list:
        for f in findings:
            print("  " + f)
    if args.write_baseline:
        with open(BASELINE, "w", encoding="utf-8") as f:
            f.write("# Known findings of tools/shape.py, being worked off: delete a line when it is fixed.\n")
            for finding in sorted(set(map(key, findings))):
                f.write(finding + "\n")
        print(f"shape: wrote {len(set(findings))} findings to {rel(BASELINE)}")
        return 0
    known = set()
    if os.path.exists(BASELINE):
        with open(BASELINE, encoding="utf-8") as f:
            known = {line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")}
    now = set(map(key, findings))
    new, gone = sorted(now - known), sorted(known - now)
    for f in new:
        print("shape: NEW   " + f)
    for f in gone:
        print("shape: FIXED " + f + "  (delete it from tools/shape-baseline.txt)")
    print(f"shape: {len(now)} findings, {len(now & known)} known, {len(new)} new, {len(gone)} fixed")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
