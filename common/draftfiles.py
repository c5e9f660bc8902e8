"""A pool's draft weight files and their fingerprint, without torch: the decoder binds the
files, the oracle keys its tables by the fingerprint, and the predictor (which never imports
torch) checks that its ranking head was trained for these very drafts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from memspec.common.config import PoolConfig
from memspec.common.errors import ModelError
from memspec.common.files import sha256_file


def draft_weights_file(model_dir: Path) -> Path:
    """A draft's one weights file (a draft must fit one slot: never sharded)."""
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        if any(Path(model_dir).glob("model-*-of-*.safetensors")):
            raise ModelError(f"draft {model_dir} has sharded weights",
                             "re-save it as one model.safetensors (drafts must fit one slot)")
        raise ModelError(f"draft weights {path} not found", "run `memspec zoo drafts` or fix the path")
    return path


def pool_fingerprint(pool: PoolConfig) -> dict[str, str]:
    """sha256 of every draft's weights file, by draft name (pool order); and the context
    lookup's setting when it is on (it changes what a draft proposes)."""
    fp = {d.name: sha256_file(draft_weights_file(d.path)) for d in pool.drafts}
    if pool.lookup:
        fp["(lookup)"] = str(pool.lookup)
    return fp


def fingerprint_digest(fp: Mapping[str, str]) -> str:
    """A short hash of a pool fingerprint (its drafts' bytes), comparable across files."""
    return hashlib.sha256(json.dumps(dict(fp), sort_keys=True).encode()).hexdigest()[:16]
