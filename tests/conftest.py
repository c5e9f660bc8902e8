"""Shared fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before torch / transformers load
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the suite runs several processes

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from tinymodels import make_tiny, save_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A target and three drafts (self copy, random, smaller) as HF folders."""
    root = tmp_path_factory.mktemp("tiny")
    save_model(make_tiny(0), root / "target")
    save_model(make_tiny(0), root / "self")
    save_model(make_tiny(1, layers=1), root / "random")
    save_model(make_tiny(2, layers=1, hidden=32), root / "small")
    return root
