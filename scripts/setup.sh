# Sourced by scripts/run.sh and scripts/test.sh: installs what Folio needs to build on a
# Debian/Ubuntu machine (system packages when run as root, npm packages, crates) and sets the
# shared build cache. Safe to run again: it installs only what is missing.
set -euo pipefail

FOLIO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export FOLIO_ROOT
# One cargo target dir outside the clone, so fresh clones (CI) reuse earlier builds.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/folio-target}
# Cargo reuses a test binary built from a clone at another path, with that path baked in: its
# dep-info does not track env!("CARGO_MANIFEST_DIR") (docs/ci.md). When the last clone to use this
# target dir was another, mark the files that read it as changed so that they are rebuilt.
mkdir -p "$CARGO_TARGET_DIR"
if [ "$(cat "$CARGO_TARGET_DIR/.folio-clone" 2>/dev/null)" != "$FOLIO_ROOT" ]; then
  (cd "$FOLIO_ROOT" && { grep -rl --include='*.rs' --exclude-dir=target CARGO_MANIFEST_DIR context-file runtime kernels method-kernels models eval library ingest src-tauri tests || true; } | xargs -r touch)
  echo "$FOLIO_ROOT" >"$CARGO_TARGET_DIR/.folio-clone"
fi

# Tauri (webkit2gtk 4.1), the desktop tests (Xvfb, WebKitWebDriver for tauri-driver, xdotool to type,
# ImageMagick for screenshots), xz for the GPU bundle, Python with pip for
# scripts/cuda-toolchain.sh (CUDA compiler wheels), and MinGW-w64 for the test command's Windows
# compile check (the C and C++ of SQLite, ring and the tokenizer's suffix array, built for Windows).
FOLIO_APT_PACKAGES=(build-essential pkg-config curl file libssl-dev libwebkit2gtk-4.1-dev libxdo-dev
  libayatana-appindicator3-dev librsvg2-dev xvfb xauth xdotool imagemagick webkit2gtk-driver xz-utils
  python3 python3-pip gcc-mingw-w64-x86-64 g++-mingw-w64-x86-64)

folio_missing_packages() {
  local p missing=()
  for p in "${FOLIO_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  command -v npm >/dev/null || missing+=(nodejs npm)
  echo "${missing[@]:-}"
}

missing=$(folio_missing_packages)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing system packages: $missing" >&2
    apt-get update -q >&2
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >&2
  else
    echo "setup: missing system packages: $missing" >&2
    echo "setup: install them (sudo apt-get install $missing) or run this script as root" >&2
    exit 1
  fi
fi

command -v cargo >/dev/null || { echo "setup: cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
# Vite 7 needs Node.js 20.19+ or 22.12+.
if ! node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 22 || (a === 22 && b >= 12) || (a === 20 && b >= 19) ? 0 : 1)' 2>/dev/null; then
  echo "setup: Node.js $(node --version 2>/dev/null || echo none) is too old: the UI build (Vite 7) needs Node.js 20.19+ or 22.12+" >&2
  exit 1
fi
for tool in fmt clippy; do
  if ! cargo "$tool" --version >/dev/null 2>&1; then
    command -v rustup >/dev/null || { echo "setup: cargo $tool is missing (install rustfmt/clippy for your Rust)" >&2; exit 1; }
    rustup component add "${tool/fmt/rustfmt}" >&2
  fi
done

# tauri-driver: the WebDriver server the window tests drive the app through (in front of
# WebKitWebDriver). Pinned; installed once into cargo's bin folder.
TAURI_DRIVER_VERSION=2.1.0
if ! cargo install --list | grep -qx "tauri-driver v$TAURI_DRIVER_VERSION:"; then
  echo "setup: installing tauri-driver $TAURI_DRIVER_VERSION" >&2
  cargo install --locked --quiet tauri-driver --version "$TAURI_DRIVER_VERSION" >&2
fi
export PATH="$HOME/.cargo/bin:$PATH"

# UI dependencies, exactly as locked; reinstalled when the lock file changes.
lock_hash=$(sha256sum "$FOLIO_ROOT/ui/package-lock.json" | cut -d' ' -f1)
stamp="$FOLIO_ROOT/ui/node_modules/.folio-lock-sha256"
if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_hash" ]; then
  (cd "$FOLIO_ROOT/ui" && npm ci --no-audit --no-fund >&2)
  echo "$lock_hash" > "$stamp"
fi
