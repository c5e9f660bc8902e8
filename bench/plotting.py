"""matplotlib for the benchmarks' `--plots`: an optional extra (`memspec[plots]`, also in
`memspec[bench]`), so a runtime install does not carry Pillow, fonttools and the rest."""

from __future__ import annotations

from typing import Any

from memspec.common.errors import MemspecError

INSTALL = "pip install 'memspec[plots]'"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a one-line error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise MemspecError("plots need matplotlib, which is not installed",
                           f"install it with {INSTALL}, or run without --plots") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
