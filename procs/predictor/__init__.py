"""Predictor process (BERT encoder + ranking head); see issue 4.

Torch-free on import, so the process can check its setup before loading anything heavy.
"""

from pathlib import Path

from memspec.common.paths import PACKAGE_ROOT

DEFAULT_HEAD = PACKAGE_ROOT / "predictor" / "head.safetensors"
FALLBACK = "fallback: "  # PredictorInfo.head starts so when no trained head ranks the pool


def pool_head_path(pool_file: Path | None) -> Path | None:
    """Where `memspec predictor train --pool P` writes P's head: beside P, named after it
    (``P.head.safetensors`` + ``P.head.json``), so the committed head is never replaced."""
    if pool_file is None:
        return None
    pool_file = Path(pool_file)
    return pool_file.with_name(f"{pool_file.stem}.head.safetensors")
