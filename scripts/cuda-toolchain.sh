#!/usr/bin/env bash
# Sourced by scripts/test.sh, scripts/run.sh and scripts/package.sh (and by hand before a
# `--features cuda` build): a CUDA 13.0 compiler on a machine with no GPU and no system CUDA
# toolkit, so that the CUDA build compiles here and its binary runs on any machine.
#
#   source scripts/cuda-toolchain.sh              # install once (cached), then export the env
#
# Why this shape:
#   * nvcc and its headers come from NVIDIA's compiler wheels on PyPI (a registry every build
#     machine reaches), pinned to 13.0: PTX from a newer nvcc does not load on a 580-series driver
#     (folio_runtime::gpu::KERNELS_CUDA_VERSION says the same to a person whose driver is older).
#   * Nothing is linked against a CUDA library that only a GPU machine has: candle's cudarc opens
#     them when the program first uses the GPU (third_party/README.md), so the build needs no
#     driver and the binary starts on a machine without one and runs on its CPU. The one CUDA
#     library candle-kernels links (`-lcudart`, for its MoE kernels' launcher) is linked
#     statically: LIBRARY_PATH names a folder whose libcudart.a is the wheel's libcudart_static.a.
#   * CUDA_COMPUTE_CAP defaults to 80: the kernels are PTX for compute_80, which the driver
#     compiles on first use for every GPU from Ampere on (8.0, 8.6, 8.9, 9.0, 12.0), so one
#     binary serves them all; Hopper-only kernels (*_sm90a.cu) are compiled for compute_90a
#     whatever it is. Set it before sourcing to compile for one newer GPU only.
# A cold build of candle's CUDA kernels takes ~15 minutes on 2 cores; keep CARGO_TARGET_DIR stable.

_fc_home=${FOLIO_CUDA_HOME:-$HOME/.cache/folio-cuda}
_fc_tk=$_fc_home/toolkit
_fc_link=$_fc_home/link
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

_fc_main() {
  command -v python3 >/dev/null || { _fc_fail "python3 is needed to install the compiler wheels"; return 1; }
  command -v gcc >/dev/null || { _fc_fail "gcc is needed: nvcc compiles with it"; return 1; }
  if [ ! -x "$_fc_cu/bin/nvcc" ] || [ ! -d "$_fc_cu/include/nv" ]; then _fc_install || return 1; fi
  mkdir -p "$_fc_link" && ln -sf "$_fc_cu/lib/libcudart_static.a" "$_fc_link/libcudart.a" || return 1
  export CUDA_HOME=$_fc_cu CUDA_PATH=$_fc_cu
  export PATH=$_fc_cu/bin:$PATH
  export LIBRARY_PATH=$_fc_link${LIBRARY_PATH:+:$LIBRARY_PATH}
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
  echo "cuda-toolchain: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2
}

_fc_main "$@"
