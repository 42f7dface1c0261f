#!/usr/bin/env bash
# The run command (README.md): installs what it needs, builds Folio and opens the desktop
# window. Extra arguments go to folio (e.g. --model ~/models/Qwen2.5-7B-Instruct).
# The build has CUDA (scripts/cuda-toolchain.sh installs the compiler; no GPU or driver is
# needed to build): it runs on the GPU when the machine has a usable one and on the CPU when not,
# and Settings → Engine says why not. FOLIO_CPU_ONLY=1 builds without CUDA (~15 min less on 2 cores).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$FOLIO_ROOT"
features=()
if [ "${FOLIO_CPU_ONLY:-0}" != 1 ]; then
  source scripts/cuda-toolchain.sh
  features=(--features cuda)
fi
cargo build --release -p folio --locked "${features[@]}"
exec "$CARGO_TARGET_DIR/release/folio" "$@"
