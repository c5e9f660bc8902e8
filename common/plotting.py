"""matplotlib for the benchmarks' `--plots`: an optional extra (`memspec[plots]`, also in
`memspec[bench]`), so a runtime install does not carry Pillow, fonttools and the rest."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
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


def save_outputs(res: dict[str, Any], args: Any, plot: Callable[[dict[str, Any], Path], Path],
                 indent: int = 1) -> None:
    """A bench command's `--json` file and `--plots` folder, when asked for. The JSON
    names the code, machine, kernel path, tuned knobs and pool it measured
    (common/provenance.py), adding what the bench's own record lacks."""
    if args.json:
        from memspec.common.provenance import complete

        res = {**res, "provenance": complete(res.get("provenance"), getattr(args, "pool", None),
                                             uses_pool=hasattr(args, "pool"))}
        Path(args.json).write_text(json.dumps(res, indent=indent))
    if args.plots:
        print(f"plot: {plot(res, Path(args.plots))}")


def finish_figure(fig: Any, path: Path, title: str, dpi: int = 120, size: int = 9) -> Path:
    """A figure's title (the machine it was measured on), layout, PNG at `path`, closed."""
    plt = pyplot()
    fig.suptitle(title, fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
