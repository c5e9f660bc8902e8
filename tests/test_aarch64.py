"""The whole native forward on aarch64: cross-built with Debian's aarch64 compiler against
PyTorch's aarch64 wheel, run under qemu-aarch64 by an aarch64 Python, token for token
against the portable (generic) path here.

The block kernels alone are checked on both aarch64 paths in test_isa.py; this runs what
surrounds them (the C++ forward, its worker pool, the PyTorch glue, the weight packing in
Python) as an ARM board would. `launch/setup.sh --dev` makes the aarch64 Python
(`python3 -m memspec.zoo.aarch64root`); where it, the cross compiler or qemu is missing the
test skips, printing why."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from forward_run import PROMPT, run
from tinymodels import make_tiny, save_model

from memspec.common import isa
from memspec.common.paths import memspec_home
from memspec.procs.decoder.forward import native
from memspec.zoo import aarch64root

PATH = "neon-dotprod"  # the path of every ARMv8.2+ core (Jetson Orin, Graviton 2+, Pi 5)
HERE = Path(__file__).resolve().parent


def _cross_build(cxx: str, where: Path) -> Path:
    """The extension as native.py builds it (same sources and flags), for aarch64; cached
    under $MEMSPEC_HOME/build by a hash of everything that shapes it."""
    torch_dir = where / "site" / "torch"
    pyinc = where / "root" / "usr" / "include"
    name = f"memspec_lean_cpu_{PATH.replace('-', '_')}"
    flags = ["-std=c++20", "-fPIC", *native.CFLAGS, *isa.compile_flags_for("aarch64", PATH),
             f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-D_GLIBCXX_USE_CXX11_ABI=1",
             *(f"-isystem{p}" for p in (torch_dir / "include",
                                        torch_dir / "include/torch/csrc/api/include",
                                        pyinc / "python3.11", pyinc))]
    digest = hashlib.sha256(" ".join([cxx, *flags, json.dumps(aarch64root.status(where))])
                            .encode())
    for src in native.SOURCES + native.HEADERS:
        digest.update(src.read_bytes())
    out = memspec_home() / "build" / f"aarch64-{PATH}-{digest.hexdigest()[:10]}"
    so = out / f"{name}.so"
    if so.is_file():
        return so
    out.mkdir(parents=True, exist_ok=True)
    procs = [(src, subprocess.Popen([cxx, *flags, "-c", str(src), "-o", str(out / f"{src.stem}.o")],
                                    stderr=subprocess.PIPE, text=True))
             for src in native.SOURCES]
    for src, proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, (src.name, err[-2000:])
    link = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, sorted(out.glob("*.o"))),
                           f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch", "-ltorch_cpu",
                           "-ltorch_python", "-o", str(so)], capture_output=True, text=True)
    assert link.returncode == 0, link.stderr[-2000:]
    return so


@pytest.mark.slow
def test_the_whole_forward_on_aarch64_gives_the_generic_tokens(tmp_path):
    """int4, int8 and fp32 weights, a prefill and 12 greedy steps: the same tokens as the
    generic path on this machine, logits within float rounding (the aarch64 compiler fuses
    multiply-adds that the x86 generic build keeps apart)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (apt install g++-aarch64-linux-gnu)")
    if aarch64root.qemu() is None:
        pytest.skip("no qemu-aarch64 (apt install qemu-user-static)")
    state = aarch64root.status()
    if not state.get("ok"):
        pytest.skip(f"no aarch64 Python: {state.get('why')} ({aarch64root.COMMAND})")
    ext_here = native.extension(isa="generic")
    if ext_here is None:
        pytest.skip("the generic native forward does not build here")
    model = save_model(make_tiny(0, hidden=128, layers=2), tmp_path / "tiny")
    so = _cross_build(cxx, aarch64root.home())
    # the package as `memspec` for the aarch64 Python: a link to this checkout
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "memspec").symlink_to(Path(native.__file__).parents[3])
    out = subprocess.run([*aarch64root.python_command(), str(HERE / "forward_run.py"),
                          str(model), str(so)], capture_output=True, text=True, timeout=900,
                         env=aarch64root.python_env(path=(str(tmp_path / "pkg"),)))
    assert out.returncode == 0, out.stderr[-3000:]
    arm = json.loads(out.stdout.strip().splitlines()[-1])
    assert arm["machine"] == "aarch64" and arm["path"] == PATH
    for fmt, got in arm["runs"].items():
        want = run(model, ext_here, fmt, PROMPT, len(got["tokens"]))
        assert got["tokens"] == want["tokens"], fmt
        gap = max(abs(a - b) for a, b in zip(got["logits"], want["logits"]))
        print(f"{fmt}: {len(got['tokens'])} tokens identical, largest logit gap {gap:.2e}",
              file=sys.stderr)
        assert gap < 1e-3, (fmt, gap)
