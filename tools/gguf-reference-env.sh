#!/usr/bin/env bash
# The Python environment tools/make_gguf_fixtures.py runs in: numpy, the gguf package (the
# writer llama.cpp's converter uses), safetensors, and llama-cpp-python built from its source
# distribution on this machine (llama.cpp's quantizer and its logits are the references).
# Building llama.cpp takes about 10 minutes on 2 cores. Usage:
#   tools/gguf-reference-env.sh && ~/.cache/folio-gguf-venv/bin/python tools/make_gguf_fixtures.py
set -euo pipefail
VENV="${FOLIO_GGUF_VENV:-$HOME/.cache/folio-gguf-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q numpy==2.4.6 gguf==0.19.0 safetensors==0.8.0
# The CPU build only, no server or examples; -march=native as a person's own build would be.
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF" \
    "$VENV/bin/pip" install -q --no-binary llama-cpp-python llama-cpp-python==0.3.36
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
