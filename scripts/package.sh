#!/usr/bin/env bash
# Packages Folio for installation with tauri's bundler: a .deb (desktop entry, icon, the .folio
# file type opened with Folio, the bundled demo model; version from Cargo.toml) and an AppImage.
# Without arguments it packages the release build with CUDA (one build for every machine: it
# runs on the GPU where there is one and on the CPU where there is not; scripts/cuda-toolchain.sh
# installs the compiler). `--debug` packages the debug build for the CPU only (what the test
# command installs; fast to build, large). The AppImage needs tauri's AppImage tools (AppRun, linuxdeploy), fetched
# from GitHub the first time: where GitHub cannot be reached the .deb is made alone and the
# reason said. Packages land in $CARGO_TARGET_DIR/{debug,release}/bundle/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$FOLIO_ROOT"
profile=(--features cuda)
if [ "${1:-}" = "--debug" ]; then
  profile=(--debug)
else
  source scripts/cuda-toolchain.sh
fi
(cd ui && npm run --silent build)
tauri=ui/node_modules/.bin/tauri
"$tauri" build "${profile[@]}" --bundles deb
if ! "$tauri" build "${profile[@]}" --bundles appimage; then
  echo "package.sh: no AppImage (tauri's AppImage tools could not be fetched from GitHub); the .deb is made" >&2
fi
