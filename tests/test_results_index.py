"""The committed result files: every one is read by a document, every cited one exists, and
the index (docs/results/README.md) says what each measured."""

from __future__ import annotations

import re

from memspec.bench.results_index import INDEX, RESULTS_DIR, reader_texts, readers, render

CITED = re.compile(r"docs/results/([A-Za-z0-9_.-]+\.json)")


def test_the_index_is_current():
    assert INDEX.read_text() == render(), \
        "regenerate: python3 -m memspec.bench.results_index > docs/results/README.md"


def test_every_result_is_read_and_every_cited_result_exists():
    texts = reader_texts()
    files = sorted(p.name for p in RESULTS_DIR.glob("*.json"))
    assert files, "no result files"
    unread = [f for f in files if not readers(f, texts)]
    assert not unread, f"results no document reads (remove them or cite them): {unread}"
    cited = {m for text in texts.values() for m in CITED.findall(text)}
    assert cited <= set(files), f"cited but missing: {sorted(cited - set(files))}"


def test_a_row_names_the_code_machine_and_kernel_path(tmp_path):
    import json

    from memspec.bench.results_index import describe

    (tmp_path / "bench_memory_x.json").write_text(json.dumps(
        {"provenance": {"commit": "a" * 40, "clean": False, "isa": "avx2"},
         "machine": "CPU AMD EPYC (avx2 kernels, forced from avx512-bf16), 2 threads"}))
    row = describe(tmp_path / "bench_memory_x.json")
    assert row == {"file": "bench_memory_x.json", "command": "memspec bench memory",
                   "commit": "aaaaaaa (tree not clean)", "machine": "AMD EPYC", "isa": "avx2"}
    (tmp_path / "zoo_eval_y.json").write_text(json.dumps({"numerics": "int4-avx512-bf16"}))
    row = describe(tmp_path / "zoo_eval_y.json")
    assert row["commit"] == "not recorded" and row["isa"] == "avx512-bf16"
