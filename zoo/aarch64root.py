"""An aarch64 Python with PyTorch, run under qemu-user, for the forward's aarch64 test.

`python3 -m memspec.zoo.aarch64root` makes, under `$MEMSPEC_HOME/aarch64/`:
- `root/`: Debian's arm64 Python 3.11 (python3.11-minimal, its standard library, its
  headers and the shared libraries they load), unpacked from the packages (`apt-get download`, after
  `dpkg --add-architecture arm64`; nothing is installed into this machine's own system),
  beside the C library of Debian's aarch64 cross compiler;
- `site/`: PyTorch for aarch64 and what it imports, plus safetensors, from the package
  index (`pip install --target`). PyTorch 2.9.1: the last release whose aarch64 wheel on
  PyPI is a CPU build (later ones need NVIDIA's CUDA libraries to import);
- `status.json`: versions, or why it could not be made.

`launch/setup.sh --dev` runs it where it is root with apt and qemu-aarch64 (about a minute
and a half on 2 cores; a rerun with `status.json` in place takes no time). Progress goes to
stderr; stdout gets one line: where it is, or why not (exit status 1).
tests/test_aarch64.py cross-builds the native forward against `site/`'s PyTorch and runs
it with `qemu-aarch64 -L root root/usr/bin/python3.11`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from memspec.common.paths import memspec_home

TORCH = "torch==2.9.1"
PYTHON = "3.11"
# pure-Python dependencies of PyTorch that its import loads, and safetensors for the weights
WHEELS = (TORCH, "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
          "filelock", "fsspec", "safetensors")
DEBS = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
        "libpython3.11-dev", "libexpat1",
        "zlib1g", "libffi8", "libssl3", "libbz2-1.0", "liblzma5", "libuuid1", "libsqlite3-0",
        "libncursesw6", "libtinfo6", "libcrypt1")
CROSS_LIBC = Path("/usr/aarch64-linux-gnu/lib")  # from g++-aarch64-linux-gnu
COMMAND = "python3 -m memspec.zoo.aarch64root"


def home() -> Path:
    return memspec_home() / "aarch64"


def qemu() -> str | None:
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def python_command(where: Path | None = None) -> list[str]:
    """The argv prefix that runs the aarch64 Python (``status()`` says whether it exists)."""
    where = where or home()
    q = qemu() or "qemu-aarch64"
    return [q, "-cpu", "max", "-L", str(where / "root"), str(where / "root/usr/bin/python3.11")]


def python_env(where: Path | None = None, path: tuple[str, ...] = ()) -> dict[str, str]:
    where = where or home()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONHOME"] = str(where / "root/usr")
    env["PYTHONPATH"] = os.pathsep.join([str(where / "site"), *path])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the project's own __pycache__ is the host's
    return env


def status(where: Path | None = None) -> dict:
    try:
        return json.loads(((where or home()) / "status.json").read_text())
    except (OSError, ValueError):
        return {"ok": False, "why": f"not made yet (run {COMMAND})"}


def _log(msg: str) -> None:
    print(f"[aarch64root] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {tail[0][:300]}")


def _debs(dest: Path) -> None:
    """Download the arm64 packages (adding the architecture to dpkg's list if needed)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = [f"{d}:arm64" for d in DEBS]
    try:
        _run(["apt-get", "download", *names], cwd=dest)
        return
    except RuntimeError:
        pass
    foreign = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True,
                             text=True).stdout.split()
    if "arm64" not in foreign:
        _run(["dpkg", "--add-architecture", "arm64"])
    _run(["apt-get", "update", "-q"])
    _run(["apt-get", "download", *names], cwd=dest)


def make(where: Path) -> dict:
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"no {tool} (Debian's package tools unpack the arm64 Python)")
    if qemu() is None:
        raise RuntimeError("no qemu-aarch64 (apt install qemu-user-static)")
    if not (CROSS_LIBC / "ld-linux-aarch64.so.1").exists():
        raise RuntimeError("no aarch64 C library (apt install g++-aarch64-linux-gnu)")
    t0 = time.perf_counter()
    tmp = where.with_name(where.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _log("arm64 Python from Debian's packages")
    _debs(tmp / "debs")
    root = tmp / "root"
    for deb in sorted((tmp / "debs").glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(root)])
    libdir = root / "lib" / "aarch64-linux-gnu"
    libdir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(CROSS_LIBC, libdir, dirs_exist_ok=True, symlinks=True)
    (root / "lib" / "ld-linux-aarch64.so.1").symlink_to("aarch64-linux-gnu/ld-linux-aarch64.so.1")
    shutil.rmtree(tmp / "debs")
    _log(f"{TORCH} for aarch64 and its imports from the package index (~100 MB)")
    _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "--no-deps", "--target", str(tmp / "site"), "--only-binary=:all:",
          "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64",
          "--python-version", PYTHON, "--implementation", "cp", *WHEELS])
    _log("checking: import torch under qemu")
    probe = "import platform, torch; print(platform.machine(), torch.__version__)"
    out = subprocess.run([*python_command(tmp), "-c", probe], env=python_env(tmp),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or not out.stdout.startswith("aarch64"):
        raise RuntimeError(f"the aarch64 Python does not import torch: "
                           f"{(out.stderr.strip().splitlines() or [''])[-1][:300]}")
    info = {"ok": True, "python": PYTHON, "torch": out.stdout.split()[1],
            "seconds": round(time.perf_counter() - t0, 1)}
    (tmp / "status.json").write_text(json.dumps(info) + "\n")
    shutil.rmtree(where, ignore_errors=True)
    tmp.rename(where)
    return info


def main() -> int:
    where = home()
    if status(where).get("ok"):
        print(f"aarch64 Python with torch {status(where)['torch']} in {where}")
        return 0
    try:
        info = make(where)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        where.mkdir(parents=True, exist_ok=True)
        (where / "status.json").write_text(json.dumps({"ok": False, "why": str(exc)}) + "\n")
        print(f"no aarch64 Python ({exc}); the aarch64 forward test will skip")
        return 1
    print(f"aarch64 Python with torch {info['torch']} in {where} ({info['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
