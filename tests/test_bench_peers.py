"""`memspec bench`'s peers: memspec beside llama.cpp on the same prompts, interleaved, cached,
and judged by the interval's far end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memspec.bench import peers
from memspec.bench.report import checks, peer_lines
from memspec.common.errors import MemspecError

EOS = 2


class FakeLlama:
    """A llama.cpp that takes a fixed time per token (no model): what `run` sees of one."""

    def __init__(self, n_threads: int, gamma: int) -> None:
        self.threads, self.gamma, self.calls = n_threads, gamma, []
        self.gguf = Path("fake.gguf")
        self.lc = type("lc", (), {"__version__": "0"})

    def key(self) -> str:
        return "fake"

    def system_info(self) -> str:
        return "fake"

    def greedy(self, ids, max_new, eos):  # noqa: ANN001
        self.calls.append(peers.PLAIN)
        return list(range(10, 10 + max_new))

    def completion(self, ids, max_new, lookup):  # noqa: ANN001
        self.calls.append(peers.PY_LOOKUP if lookup else peers.PY)
        return max_new

    def perf(self) -> dict:  # llama.cpp's own clock of its last plain run
        return {"prefill_ms": 4.0, "prefill_tokens": 20, "decode_ms": 16.0, "decode_tokens": 8}


ROWS = [{"id": f"dev2-{d}-{i}", "domain": d, "prompt": f"{d} prompt {i}"}
        for d in ("code", "math") for i in range(3)]


def _run(tmp_path: Path, monkeypatch, ours_calls: list) -> dict:
    monkeypatch.setattr(peers, "LlamaCpp", FakeLlama)
    monkeypatch.setattr(peers, "SETTLE_S", 0.0)

    def ours(prompt: str, policy: str) -> tuple[list[int], float, dict]:
        ours_calls.append((policy, prompt))
        return list(range(10, 18)) + [EOS], 0.01, {"e2e_s": 0.009}  # 8 tokens and the EOS

    return peers.run(ROWS, ours, lambda p: [1, 2, 3], {EOS}, 8, 4, tmp_path / "peers.jsonl",
                     "fp")


def test_run_counts_no_eos_rotates_and_caches(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    out = _run(tmp_path, monkeypatch, calls)
    rows = [json.loads(x) for x in (tmp_path / "peers.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS]
    # EOS not counted: memspec made 8 tokens, as llama.cpp did, and they are the same ones
    assert rows[0]["memspec"]["tokens"] == 8 and rows[0][peers.PLAIN]["tokens"] == 8
    assert rows[0]["memspec"]["runtime"] == {"e2e_s": 0.009}  # the runtime's own account
    assert out["llama_cpp_tokens_identical"] == 1.0
    assert out["tokens"]["memspec"] == 8 * len(ROWS)
    # every entry runs first on some prompt: no one always pays for a cold start
    firsts = {next(iter(k for k in r if k in (*peers.OURS, *peers.PEERS))) for r in rows}
    assert firsts == {*peers.OURS, *peers.PEERS}
    # the warm-up ran on a prompt of no set, before any measured one
    assert calls[0] == ("memspec", peers.WARM_PROMPT) and all(
        p != peers.WARM_PROMPT for _, p in calls[2:])
    assert set(out["gmean"]) == set(peers.RATIOS)
    # llama.cpp's own report of its plain runs rides beside the call-to-last-token clock
    own = out["llama_cpp_own_clock"]
    assert own["decode_tok_s"] == pytest.approx(500.0) and own["prefill_tok_s"] == 5000.0
    assert own["prefill_ms_per_prompt"] == 4.0 and own["share_of_call_clock"] > 0
    # a second run with the same fingerprint measures nothing and gives the same figures
    calls.clear()
    again = _run(tmp_path, monkeypatch, calls)
    assert calls == [] and again["gmean"] == out["gmean"]


def test_summary_ratios_and_interval() -> None:
    def entry(tok_s: float) -> dict:
        return {"tokens": 100, "seconds": 100 / tok_s, "ids": None}

    rows = [{"id": f"p{i}", "domain": "code" if i % 2 else "math",
             "memspec": entry(200 + i), "target-only": entry(150),
             peers.PLAIN: entry(100), peers.PY: entry(80), peers.PY_LOOKUP: entry(60)}
            for i in range(8)]
    out = peers.summarise(rows)
    g, ci = out["gmean"], out["ci95"]
    assert 2.0 < g["memspec_over_llama_cpp"] < 2.1
    assert g["target_only_over_llama_cpp"] == pytest.approx(1.5)
    assert g["llama_cpp_lookup_over_llama_cpp"] == pytest.approx(0.6)
    assert ci["memspec_over_llama_cpp"][0] <= g["memspec_over_llama_cpp"] \
        <= ci["memspec_over_llama_cpp"][1]
    # the report reads the bounds off the interval's far end
    result = {"peers": {**out, "threads": 2, "gamma": 4, "clock": "c"}}
    rows_ok = {c.label: c for c in checks(result) if "llama.cpp" in c.label}
    assert len(rows_ok) == 2 and all(c.ok for c in rows_ok.values())
    assert peer_lines(result)[0].startswith("memspec end to end beside llama.cpp")
    slow = {"peers": {**out, "ci95": {**ci, "memspec_over_llama_cpp": [1.4, 2.6]}}}
    assert not next(c for c in checks(slow) if "plain" in c.label).ok
    missing = [c for c in checks({}) if "llama.cpp" in c.label]
    assert missing and not any(c.ok for c in missing)


@pytest.fixture(scope="module")
def llama() -> tuple:
    """The demo target's GGUF in llama.cpp (one thread), a prompt and its EOS."""
    pytest.importorskip("llama_cpp")
    try:
        llm = peers.LlamaCpp(1, 4)
    except MemspecError as exc:  # the GGUF's wheel is not installed here
        pytest.skip(f"no GGUF: {exc}")
    ids = llm.plain.tokenize(b"The capital of France is", add_bos=False)
    return llm, ids, {llm.lc.llama_vocab_eos(llm.vocab)}


def test_c_api_greedy_is_llama_cpps_own_greedy(llama) -> None:
    """The C API loop the bench times decodes what llama-cpp-python's greedy completion
    does on the same GGUF (the plain peer does the same work as the Python one)."""
    llm, ids, eos = llama
    got = llm.greedy(ids, 12, eos)
    llm.plain.reset()
    text = llm.plain.create_completion(prompt=ids, max_tokens=12, temperature=0.0,
                                       top_k=1)["choices"][0]["text"]
    assert len(got) >= 1
    assert llm.plain.detokenize(got).decode("utf-8", "replace") == text
    assert llm.completion(ids, 12, lookup=True) == len(got)


def test_rows_at_leaves_the_context_as_it_found_it(llama) -> None:
    """The engine bench times llama.cpp's step and verify with `rows_at` at one context,
    again and again: each call must leave the cache as it was, every row's logits made."""
    llm, ids, eos = llama
    want = llm.greedy(ids, 6, eos)
    llm.reset()
    llm.decode(ids[:-1])
    for rows in ([ids[-1]], [ids[-1], *want[:4]]):
        batch = llm.rows(rows, len(ids) - 1)
        llm.rows_at(batch, len(ids) - 1)
        llm.free(batch)
        # row 0 of the last call saw the whole prompt: it predicts the first token
        ptr = llm.lc.llama_get_logits_ith(llm._ctx, 0)
        assert int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab,)).argmax()) == want[0]
        if len(rows) > 1:  # the rows after it predict the greedy continuation
            ptr = llm.lc.llama_get_logits_ith(llm._ctx, len(rows) - 1)
            assert int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab,)).argmax()) == want[4]
    llm.decode([ids[-1]])  # the cache still ends where the context did
    assert llm.argmax() == want[0]


def test_order_gives_every_entry_both_neighbours() -> None:
    names = (*peers.OURS, *peers.PEERS)
    before = {n: set() for n in names}
    for i in range(2 * len(names)):
        got = peers.order(i, names)
        assert sorted(got) == sorted(names)
        for a, b in zip(got, got[1:]):
            before[b].add(a)
    # memspec once always ran right after llama.cpp's prompt lookup
    assert all(len(v) == 2 for v in before.values()), before


def test_a_run_too_long_for_llama_cpp_is_one_line(llama) -> None:
    llm, _, _ = llama
    with pytest.raises(MemspecError, match="exceeds its context"):
        llm.greedy([1] * 100, peers.N_CTX, set())
