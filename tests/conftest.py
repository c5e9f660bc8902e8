"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tinymodels import make_tiny, save_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A target and three drafts (self copy, random, smaller) as HF folders."""
    root = tmp_path_factory.mktemp("tiny")
    save_model(make_tiny(0), root / "target")
    save_model(make_tiny(0), root / "self")
    save_model(make_tiny(1, layers=1), root / "random")
    save_model(make_tiny(2, layers=1, hidden=32), root / "small")
    return root
