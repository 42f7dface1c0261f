#!/usr/bin/env bash
# The test command (README.md): installs what it needs, then formatting, lints, every test,
# the code's measured shape, and a compile of the CUDA build (no GPU needed: scripts/cuda-toolchain.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$FOLIO_ROOT"

step() { echo; echo "== $* ($(date +%T))"; }

step "UI type check (svelte-check) and unit tests (vitest)"
(cd ui && npm run --silent check && npm run --silent test)

step "demo and yardstick data, tokenizers, template and eval specs (tools/test_demo.py, tools/test_yardstick.py)"
# numpy, tokenizers, jinja2 and openai: from the system when present, else pip-installed into a cache
# folder (the way scripts/cuda-toolchain.sh installs its wheels).
py_deps="$HOME/.cache/folio-py"
# openai: the official client tests/serve.rs runs against `folio serve`.
if ! python3 -c "import numpy, tokenizers, jinja2, openai" 2>/dev/null; then
  # An earlier run's install is reused rather than downloaded again.
  export PYTHONPATH="$py_deps${PYTHONPATH:+:$PYTHONPATH}"
  if ! python3 -c "import numpy, tokenizers, jinja2, openai" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check --target "$py_deps" numpy tokenizers jinja2 openai >&2
  fi
fi
python3 tools/test_demo.py assets/models/demo | tail -n 3
python3 tools/test_yardstick.py | tail -n 3

step "the code's shape: import cycles, upward imports, long files and functions (tools/shape.py)"
python3 tools/test_shape.py
python3 tools/shape.py

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "Windows compile check: every crate, the app included, for x86_64-pc-windows-gnu (docs/install.md)"
if command -v rustup >/dev/null; then
  rustup target list --installed | grep -qx x86_64-pc-windows-gnu || rustup target add x86_64-pc-windows-gnu
  # Warnings are errors in Folio's crates there too (dependencies' lints are capped by cargo).
  CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUSTFLAGS="-D warnings" cargo check --target x86_64-pc-windows-gnu --workspace --locked
else
  echo "skipped: no rustup to add the Windows target to this Rust (docs/install.md)"
fi

step "the .deb of the debug build (scripts/package.sh; tests/install.rs installs it)"
(cd ui && npm run --silent build)
ui/node_modules/.bin/tauri build --debug --bundles deb

step "cargo test"
cargo test --workspace --locked

step "CUDA build: compiled here, and run here with no GPU (it must answer on the CPU and say why)"
source scripts/cuda-toolchain.sh
cargo clippy --workspace --no-default-features --features cuda --all-targets --locked -- -D warnings
cargo build --workspace --no-default-features --features cuda --tests --locked
cargo test -p folio --no-default-features --features cuda --test cuda_build --locked
echo
echo "all checks passed"
