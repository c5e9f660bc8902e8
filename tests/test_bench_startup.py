"""`memspec bench startup` on a short run: every way answers the README's prompt, the reused
way really used the running server and gave the fresh way's text, the per-process start-up
is reported, and the table and the PNG are written (timings are not asserted)."""

from __future__ import annotations

from test_pipeline import _ready_pool

from memspec.bench import peers
from memspec.bench.startup import format_table, plot, run


def test_startup_bench_runs_every_way(tmp_path):
    _ready_pool()
    res = run(None, 1, 8)
    ways = {"fresh", "reused"} | ({"llama.cpp"} if peers.available() else set())
    assert set(res["median"]) == ways and {r["way"] for r in res["rows"]} == ways
    assert all(r["reused"] == (r["way"] == "reused") for r in res["rows"])
    assert res["same_text_fresh_reused"]
    assert all(r["text"] for r in res["rows"])
    assert set(res["procs"]) == {"decoder", "loader", "predictor"}
    assert all(p["ready_s"] > 0 for p in res["procs"].values())
    assert "process" in res["procs"]["decoder"]["startup"]
    assert res["provenance"]["commit"] and res["isa"]
    assert "first text s" in format_table(res)
    plot(res, tmp_path / "startup.png")
    assert (tmp_path / "startup.png").read_bytes()[:4] == b"\x89PNG"
