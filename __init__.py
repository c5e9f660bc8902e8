"""memspec: memory-aware runtime for adaptive multi-draft speculative decoding.

The repository root is the package: ``procs/`` (decoder, loader, predictor),
``common/`` (shared schemas, config, metrics), ``launch/`` (CLI, supervisor),
``zoo/`` (model acquisition and training) and ``bench/`` install as
``memspec.procs``, ``memspec.common`` and so on.
"""

__version__ = "0.1.0"

import os as _os

# A process the supervisor started runs no cyclic collection until it is ready
# (common/child.py `freeze_heap` collects once, freezes and turns them back on): its start
# allocates about a million objects (torch's import), and collection after collection
# walked them all again. Taken from the environment, so its own subprocesses collect as usual.
_gc_held = _os.environ.pop("MEMSPEC_START_NO_GC", "") == "1"
if _gc_held:
    import gc as _gc

    _gc.disable()

if _os.environ.get("MEMSPEC_ISA"):  # a forced kernel path holds for PyTorch's kernels too
    from memspec.common.isa import torch_env as _torch_env

    for _key, _value in _torch_env(_os.environ["MEMSPEC_ISA"].strip().lower()).items():
        _os.environ.setdefault(_key, _value)

__all__ = ["Result", "Runtime", "Stream", "__version__"]


def __getattr__(name: str):  # noqa: ANN202
    """`from memspec import Runtime` imports the runtime only when asked: the package root
    is also the command line's package, which must start fast."""
    if name in ("Runtime", "Result", "Stream"):
        from memspec.launch import api

        return getattr(api, name)
    raise AttributeError(f"module 'memspec' has no attribute {name!r}")
