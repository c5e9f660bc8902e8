"""Any pool starts and keeps serving, through the three real processes.

A tiny Qwen2 target with two user-named drafts and no predictor head: every policy is
token-identical to target-only (the predictor ranks by description similarity and says so
once). Drafts that are corrupt (same size, caught by the manifest), truncated or of a
smaller vocabulary are quarantined at start, a draft corrupted while the server runs is
quarantined at its next load; either way decoding goes on, `status` shows it and the
supervisor logs it once.
"""

from __future__ import annotations

import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tinymodels import byte_tokenizer_json, make_tiny_qwen2, save_model

from memspec.common import logs
from memspec.common.config import POLICIES as ALL_POLICIES
from memspec.common.config import load_pool
from memspec.common.errors import RequestError
from memspec.common.manifest import write_manifest
from memspec.common.messages import Done, Message, PredictorInfo, Submit
from memspec.common.paths import memspec_home
from memspec.launch.client import status as client_status
from memspec.launch.supervisor import Supervisor
from memspec.procs.predictor import FALLBACK
from memspec.procs.predictor.encoder import encoder_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not encoder_available(), reason="MiniLM encoder missing")]
PROMPTS = ["Write a Python function that adds two numbers.",
           "What are the symptoms of measles?"]
POLICIES = tuple(p for p in ALL_POLICIES if p != "target-only")
MAX_NEW = 20


def corrupt_same_size(path: Path) -> None:
    """Overwrite 256 bytes in place (never truncated, so a load in flight sees the same
    size; what it reads is the old or the new bytes)."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size * 2 // 3)
        raw = f.read(256)
        f.seek(-len(raw), 1)
        f.write(bytes(b ^ 0x5A for b in raw))


def write_pool(root: Path, drafts: dict[str, str], **fields: object) -> Path:
    lines = ["[pool]", f'target = "{root / "target"}"', "K = 1", "N = 2", "gamma = 3",
             'storage = "native"', f"max_new_tokens = {MAX_NEW}",
             *(f"{k} = {v!r}".replace("'", '"') for k, v in fields.items())]
    for name, folder in drafts.items():
        lines += ["", "[[drafts]]", f'name = "{name}"', f'path = "{root / folder}"']
    path = root / f"pool-{secrets.token_hex(2)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(sup: Supervisor, prompt: str, policy: str, max_new: int = MAX_NEW,
        gate: bool | None = None) -> Message:
    got = sup.run(Submit(req_id=secrets.token_hex(4), prompt=prompt, policy=policy,
                         max_new_tokens=max_new, gate=gate), timeout_s=300)
    assert got is not None, "request timed out"
    return got


def settle(sup: Supervisor, seconds: float = 1.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sup.tick(20)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, monkeypatch_module):
    """A Qwen2 target, drafts `alpha` (a copy of it) and `beta` (a random 1-layer Qwen2),
    each with a manifest; a scratch MEMSPEC_HOME (traces) that keeps the native build."""
    root = tmp_path_factory.mktemp("qwen-pool")
    tok = byte_tokenizer_json()
    save_model(make_tiny_qwen2(0), root / "target", tok)
    save_model(make_tiny_qwen2(0), root / "alpha", tok)
    save_model(make_tiny_qwen2(1, layers=1), root / "beta", tok)
    for name in ("target", "alpha", "beta"):
        write_manifest(root / name)
    home = root / "home"
    home.mkdir()
    build = memspec_home() / "build"
    if build.is_dir():
        (home / "build").symlink_to(build.resolve())
    monkeypatch_module.setenv("MEMSPEC_HOME", str(home))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _trace(pool_path: Path) -> None:
    """Acceptance tables for PROMPTS, so the oracle policies have something to replay."""
    from memspec.zoo.trace import Tracer

    prompts = [{"id": f"q{i}", "domain": "general", "prompt": p} for i, p in enumerate(PROMPTS)]
    Tracer(load_pool(pool_path)).trace_set("dev", prompts, MAX_NEW)


@pytest.fixture
def supervisor_log():
    """The supervisor's log lines on stderr, as `memspec up` writes them."""
    logs.setup("supervisor")
    yield
    logs.reset()


def test_qwen2_pool_without_a_head_is_lossless_for_every_policy_and_survives_corruption(
        qwen, capfd, supervisor_log):
    pool = write_pool(qwen, {"alpha": "alpha", "beta": "beta"})  # general: the first
    _trace(pool)
    sup = Supervisor(str(pool), cold_start=True)  # every request loads its drafts afresh
    try:
        sup.start()
        info = sup.procs["predictor"].info
        assert isinstance(info, PredictorInfo) and info.head.startswith(FALLBACK)
        assert sup.procs["decoder"].info.dtype == "int4"  # the lean forward, q/k/v bias
        refs = {}
        for p in PROMPTS:
            done = run(sup, p, "target-only")
            assert isinstance(done, Done), done
            refs[p] = done.token_ids
        used: set[str] = set()
        for policy in POLICIES:
            for p in PROMPTS:
                done = run(sup, p, policy)
                assert isinstance(done, Done), (policy, done)
                assert done.token_ids == refs[p], policy
                used |= set(done.stats.drafts_used)
        assert used == {"alpha", "beta"}
        assert sup.quarantined == {}
        err = capfd.readouterr().err
        assert err.count("ranking by similarity of the prompt") == 1  # said once

        corrupt_same_size(qwen / "alpha" / "model.safetensors")  # while the server runs
        # alpha: loaded again (ungated, so the load is asked for whatever the gate has
        # learned of costs on a busy machine), refused before it runs; then skipped. A
        # request may end before its load does (then the next start cancels it): at most
        # a few requests until one load is checked through
        for _ in range(5):
            done = run(sup, PROMPTS[0], "general-static", gate=False)
            assert isinstance(done, Done) and done.token_ids == refs[PROMPTS[0]]
            assert "alpha" not in done.stats.drafts_used
            settle(sup)
            if sup.status().quarantined:
                break
        done = run(sup, PROMPTS[0], "general-static", gate=False)
        assert isinstance(done, Done) and done.token_ids == refs[PROMPTS[0]]
        assert list(sup.status().quarantined) == ["alpha"]
        assert "differs from its manifest" in sup.status().quarantined["alpha"]
        assert "alpha" in done.stats.quarantined and "alpha" not in done.stats.drafts_used
        done = run(sup, PROMPTS[1], "memspec")
        assert isinstance(done, Done) and done.token_ids == refs[PROMPTS[1]]
        err = capfd.readouterr().err
        assert len(re.findall(r"WARNING supervisor\[\d+\]: draft 'alpha' quarantined:", err)) == 1
        with pytest.raises(RequestError, match="temperature = nan is not a finite number"):
            sup.run(Submit(req_id="nan", prompt="x", temperature=float("nan")))  # never queued
    finally:
        sup.shutdown()


def test_bad_drafts_at_start_are_quarantined_and_the_rest_serve(qwen, capfd, supervisor_log):
    tok = byte_tokenizer_json()
    for name in ("good", "flipped", "cut"):
        shutil.copytree(qwen / "beta", qwen / name, dirs_exist_ok=True)
        write_manifest(qwen / name)
    corrupt_same_size(qwen / "flipped" / "model.safetensors")
    weights = qwen / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    save_model(make_tiny_qwen2(3, vocab=200, layers=1), qwen / "narrow", tok)
    pool = write_pool(qwen, {"good": "good", "flipped": "flipped", "cut": "cut",
                             "narrow": "narrow"}, general="flipped")
    ep = f"ipc://{qwen}/status.sock"
    sup = Supervisor(str(pool), client_endpoint=ep, cold_start=True)
    try:
        sup.start()
        settle(sup)
        with ThreadPoolExecutor(1) as ex:  # `memspec status` from another process's view
            asked = ex.submit(client_status, ep)
            while not asked.done():
                sup.tick(20)
        q = asked.result().quarantined
        assert q == sup.status().quarantined
        assert set(q) == {"flipped", "cut", "narrow"}
        assert "differs from its manifest" in q["flipped"]
        assert "truncated" in q["cut"]
        assert "vocabulary of 200 tokens, the target 264, and no id map" in q["narrow"]
        ref = run(sup, PROMPTS[0], "target-only")
        for policy in ("general-static", "memspec", "mab-async"):
            done = run(sup, PROMPTS[0], policy)
            assert isinstance(done, Done) and done.token_ids == ref.token_ids, policy
        assert set(done.stats.drafts_used) <= {"good"}
        err = capfd.readouterr().err
        for name in q:
            assert len(re.findall(rf"WARNING supervisor\[\d+\]: draft '{name}' quarantined:",
                                  err)) == 1
    finally:
        sup.shutdown()


def test_soak_reports_rss_per_process_at_each_checkpoint(qwen, tmp_path):
    """The instrument behind the memory figure (`memspec bench soak`, 200 requests on the
    default pool: docs/results/bench_soak.json), on a short run; the ratio itself is not asserted."""
    from memspec.bench.soak import PROCS, format_table, plot, soak

    pool = write_pool(qwen, {"beta": "beta"})
    res = soak(str(pool), 6, 8, policies=("memspec", "target-only"), checkpoints=(2, 6),
               prompts=PROMPTS)
    assert len(res["series"]) == 6 and list(res["checkpoints"]) == ["2", "6"]
    for at in res["checkpoints"].values():
        assert set(at) == set(PROCS) and all(mb > 10 for mb in at.values())
    want = res["checkpoints"]["6"]["decoder"] / res["checkpoints"]["2"]["decoder"]
    assert res["last_over_first"]["decoder"] == round(want, 4)
    assert res["decoder_within_limit"] == (want <= res["limit"])
    assert "decoder growth" in format_table(res).splitlines()[-1]
    plot(res, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
