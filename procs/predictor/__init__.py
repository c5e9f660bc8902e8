"""Predictor process (BERT encoder + ranking head); see issue 4.

Torch-free on import, so the process can check its setup before loading anything heavy.
"""

from memspec.common.paths import PACKAGE_ROOT

DEFAULT_HEAD = PACKAGE_ROOT / "predictor" / "head.safetensors"
