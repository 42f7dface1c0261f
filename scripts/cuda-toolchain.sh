#!/usr/bin/env bash
# Sourced by scripts/test.sh (and by hand before a `--features cuda` build): a CUDA 13.0 build
# toolchain on a machine with no GPU and no system CUDA toolkit, so that the CUDA build compiles
# and links here and its binaries run on a GPU machine.
#
#   source scripts/cuda-toolchain.sh              # install once (cached), then export the env
#   source scripts/cuda-toolchain.sh --rescan DIR # also regenerate the link stubs' symbols from
#                                                 # the rlibs/static libs under cargo target DIR
#
# Why this shape:
#   * nvcc and its headers come from NVIDIA's compiler wheels on PyPI (a registry every build
#     machine reaches), pinned to 13.0: PTX from a newer nvcc does not load on a 580-series driver.
#   * The driver libraries (libcuda, nvrtc, curand, cublas) exist only where a GPU is; the
#     linker is given stubs that define their symbols (scripts/cuda-stub-symbols.txt) and nothing
#     else. At run time the GPU machine's real libraries load (LD_LIBRARY_PATH=/usr/local/cuda/lib64).
#   * LIBRARY_PATH, not RUSTFLAGS: changing RUSTFLAGS invalidates every cached crate.
#   * CUDA_COMPUTE_CAP defaults to 90 (Hopper); set it before sourcing for another GPU (>= 80).
# A cold build of candle's CUDA kernels takes ~15 minutes on 2 cores; keep CARGO_TARGET_DIR stable.

_fc_home=${FOLIO_CUDA_HOME:-$HOME/.cache/folio-cuda}
_fc_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_fc_tk=$_fc_home/toolkit
_fc_stub=$_fc_home/stubs
_fc_cu=$_fc_tk/nvidia/cu13
_fc_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96)

_fc_fail() { echo "cuda-toolchain: $*" >&2; return 1; }

_fc_install() {
  echo "cuda-toolchain: installing the CUDA 13.0 compiler wheels into $_fc_tk" >&2
  rm -rf "$_fc_tk" && mkdir -p "$_fc_tk" || return 1
  # One pip call: a second --target install into the same folder would replace nvidia/ wholesale.
  python3 -m pip install -q --disable-pip-version-check --target "$_fc_tk" "${_fc_wheels[@]}" >&2 \
    || _fc_fail "pip install of ${_fc_wheels[*]} failed"
}

# One stub library per driver library: "name soname symbol-regex".
_fc_make_stubs() {
  local syms=$1 spec
  mkdir -p "$_fc_stub" || return 1
  for spec in "cuda libcuda.so.1 ^cu[A-Z]" "nvrtc libnvrtc.so.13 ^nvrtc" "curand libcurand.so.10 ^curand" \
    "cublasLt libcublasLt.so.13 ^cublasLt" "cublas libcublas.so.13 ^cublas[^L]"; do
    # shellcheck disable=SC2086
    set -- $spec
    grep -E "$3" "$syms" | sort -u | awk '{print "void "$1"(void){}"}' >"$_fc_stub/$1.c"
    gcc -shared -fPIC -Wl,-soname,"$2" -o "$_fc_stub/lib$1.so" "$_fc_stub/$1.c" || return 1
  done
  ln -sf "$_fc_cu/lib/libcudart.so.13" "$_fc_stub/libcudart.so"
}

# Undefined CUDA symbols of every rlib/static lib under a target dir, added to the list.
_fc_rescan() {
  local dir tmp f
  dir=$(cd "$1" && pwd) || return 1
  tmp=$(mktemp -d)
  (cd "$tmp" && find "$dir" \( -name '*.rlib' -o -name '*.a' \) 2>/dev/null | while read -r f; do
    mkdir -p x && (cd x && ar x "$f" 2>/dev/null; nm -u ./* 2>/dev/null | awk '{print $2}'; rm -f ./*)
  done) | grep -E '^(cu[A-Z]|nvrtc|curand|cublas)' | cat - "$_fc_here/cuda-stub-symbols.txt" | sort -u >"$_fc_home/symbols.txt"
  rm -rf "$tmp"
  rm -f "$_fc_stub/libcuda.so"
  echo "cuda-toolchain: $(wc -l <"$_fc_home/symbols.txt") symbols for the link stubs" >&2
}

_fc_main() {
  command -v python3 >/dev/null || { _fc_fail "python3 is needed to install the compiler wheels"; return 1; }
  command -v gcc >/dev/null || { _fc_fail "gcc is needed to build the link stubs"; return 1; }
  if [ ! -x "$_fc_cu/bin/nvcc" ] || [ ! -d "$_fc_cu/include/nv" ]; then _fc_install || return 1; fi
  if [ "${1:-}" = "--rescan" ] && [ -n "${2:-}" ]; then _fc_rescan "$2"; fi
  local syms=$_fc_here/cuda-stub-symbols.txt
  [ -f "$_fc_home/symbols.txt" ] && syms=$_fc_home/symbols.txt
  # Rebuilt when the symbol list is newer than the stubs (a new release of the list).
  if [ ! -f "$_fc_stub/libcuda.so" ] || [ "$syms" -nt "$_fc_stub/libcuda.so" ]; then
    _fc_make_stubs "$syms" || { _fc_fail "building the link stubs failed"; return 1; }
  fi
  export CUDA_HOME=$_fc_cu CUDA_PATH=$_fc_cu
  export PATH=$_fc_cu/bin:$PATH
  export LIBRARY_PATH=$_fc_stub${LIBRARY_PATH:+:$LIBRARY_PATH}
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  echo "cuda-toolchain: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP, stubs in $_fc_stub" >&2
}

_fc_main "$@"
