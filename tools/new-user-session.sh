#!/usr/bin/env bash
# A new user's first session in the real window (issue #44), recorded: tests/gui_newuser.rs
# drives the app under Xvfb through WebDriver from a fresh Folio home — first start, the
# samples dropped and prefilled, every assets/SAMPLES.md question typed and sent, Settings →
# Attention's method choices measured and one applied, a restart, the chat continued — and
# its screenshots are copied to docs/app/new-user-*.png. Needs what ./scripts/test.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-$HOME/.cache/folio-target}
(cd ui && npm run build >/dev/null)
CARGO_TARGET_DIR=$target cargo test --locked --test gui_newuser -- --nocapture
for shot in "$target"/tmp/app-new-user-*.png; do
  cp "$shot" "docs/app/$(basename "$shot" | sed 's/^app-//')"
done
ls docs/app/new-user-*.png
