#!/usr/bin/env bash
# The test command (README.md): installs what it needs, then formatting, lints, every test,
# and a compile of the CUDA build (no GPU needed; see ../shared/tools/cuda-toolchain.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$FOLIO_ROOT"

step() { echo; echo "== $* ($(date +%T))"; }

step "UI type check (svelte-check)"
(cd ui && npm run --silent check)

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "CUDA build (compile and link only: no GPU here)"
toolchain=${FOLIO_CUDA_TOOLCHAIN:-$FOLIO_ROOT/../shared/tools/cuda-toolchain.sh}
if [ ! -f "$toolchain" ]; then
  echo "CUDA toolchain script not found at $toolchain (set FOLIO_CUDA_TOOLCHAIN)" >&2
  exit 1
fi
# shellcheck disable=SC1090
source "$toolchain"
cargo clippy --workspace --no-default-features --features cuda --all-targets --locked -- -D warnings
cargo build --workspace --no-default-features --features cuda --tests --locked
echo
echo "all checks passed"
