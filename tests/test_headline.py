"""`memspec bench headline`'s arithmetic and its refusals (the run itself is a bench: its
figures live in its JSON, never in a timed test)."""

from __future__ import annotations

import argparse

import pytest

from memspec.bench import headline
from memspec.common import isa
from memspec.common.errors import ConfigError


def _run(tokens: int, seconds: float, ids: list[int] | None = None) -> dict:
    return {"tokens": tokens, "seconds": seconds, "ids": ids}


def _rows(paths, unlike: str | None = None) -> list[dict]:
    rows = []
    for i in range(6):
        runs = {}
        for load in headline.LOADS:
            slow = 2.0 if load == "busy1" else 1.0
            got = {headline.PLAIN: [_run(100, 1.0 * slow)],
                   headline.LOOKUP: [_run(100, 1.25 * slow)]}
            for path in paths:
                for pol, s in zip(headline.POLICIES, (0.4, 0.5, 0.45, 0.6)):
                    ids = [1, 2, 3] if not (pol == unlike and i == 0) else [1, 2, 4]
                    got[f"{pol}@{path}"] = [_run(100, s * slow, ids)]
            runs[load] = got
        rows.append({"id": f"p{i}", "domain": "code" if i % 2 else "math", "runs": runs})
    return rows


def test_the_summary_gives_every_ratio_per_kernel_path_and_load():
    paths = ["avx512-bf16", "avx2"]
    out = headline.summarise(_rows(paths), paths, headline.LOADS)
    assert set(out) == {f"{p}/{ld}" for p in paths for ld in headline.LOADS}
    s = out["avx2/busy1"]
    assert s["gmean"]["memspec_over_target_only"] == pytest.approx(1.5)
    assert s["gmean"]["memspec_over_llama_cpp"] == pytest.approx(2.5)
    assert s["gmean"]["memspec_over_llama_cpp_lookup"] == pytest.approx(3.125)
    lo, hi = s["ci95"]["memspec_over_lookup_only"]
    assert lo <= s["gmean"]["memspec_over_lookup_only"] <= hi
    assert s["prompts_with_tokens_unlike_target_only"] == 0 and s["prompts"] == 6
    # a policy's tokens unlike target-only's on one prompt: counted, never averaged away
    odd = headline.summarise(_rows(paths, unlike="lookup-only"), paths, headline.LOADS)
    assert odd["avx512-bf16/quiet"]["prompts_with_tokens_unlike_target_only"] == 1


def test_kernel_paths_default_to_the_cpus_own_and_avx2_beside_it():
    got = headline.kernel_paths(None)
    assert got[0] == isa.native_isa()
    assert got[1:] == (["avx2"] if isa.native_isa() != "avx2" and "avx2" in isa.supported()
                       else [])
    with pytest.raises(ConfigError, match="not available"):
        headline.kernel_paths("no-such-path")


def test_a_bad_request_is_one_line_not_a_run():
    args = argparse.Namespace(split="mixed", loads=None, repeats=1, pool=None, per_domain=0,
                              max_new_tokens=8, isas=None, json=None, plots=None)
    with pytest.raises(ConfigError, match="not a set"):
        headline.main_bench_headline(args)
    args.split = "test"  # the old name of dev2
    with pytest.raises(ConfigError, match="not a set"):
        headline.main_bench_headline(args)
    args.split, args.loads = "dev", "busy9"
    with pytest.raises(ConfigError, match="not in the headline"):
        headline.main_bench_headline(args)
    args.loads, args.repeats = None, 0
    with pytest.raises(ConfigError, match="below 1"):
        headline.main_bench_headline(args)


def test_llama_cpp_runs_at_its_fastest_threads_under_each_load():
    """Every baseline at its fastest setting: beside a busy core llama.cpp on every core
    waits for the descheduled one (28-37 tok/s on 2 threads, 72-78 on 1), so it leaves the
    load its core."""
    assert headline.llama_threads("quiet", 2) == 2
    assert headline.llama_threads("busy1", 2) == 1
    assert headline.llama_threads("busy1", 1) == 1
    assert set(headline.BUSY_CORES) == set(headline.LOADS)


def test_the_round_headline_read_test2_once_and_says_the_sets_are_disjoint():
    """The round's one read of test2: its JSON counts that read and records that no source
    of test2 is in any other set."""
    import json

    from memspec.common.paths import PACKAGE_ROOT

    res = json.loads((PACKAGE_ROOT / "docs/results/headline_test2_avx512_xeon.json").read_text())
    assert res["split"] == "test2" and res["held_out_reads"] == 1
    assert res["splits"]["disjoint"] and res["splits"]["measured_on"] == ["test2"]
    assert all(v == 0 for k, v in res["splits"]["shared_sources"].items() if "test2" in k)
    assert all(s["prompts_with_tokens_unlike_target_only"] == 0
               for s in res["summary"].values())
