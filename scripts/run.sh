#!/usr/bin/env bash
# The run command (README.md): installs what it needs, builds Folio and opens the desktop
# window. Extra arguments go to folio (e.g. --model ~/models/Qwen2.5-7B-Instruct).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$FOLIO_ROOT"
cargo build --release -p folio --locked
exec "$CARGO_TARGET_DIR/release/folio" "$@"
