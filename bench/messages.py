"""`memspec bench messages`: encode + decode time of every message type, one by one.

Each message is built as the runtime builds it (a Done carries a real 64-iteration
summary, a traced Done its whole trace), encoded to frames and decoded by the receiving
socket's codec, many times; the figure is the median over repeats of the mean
microseconds per round trip.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from memspec.common.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    CONTROL,
    DECODER_REPLIES,
    DECODER_REQUESTS,
    LOADER_REPLIES,
    LOADER_REQUESTS,
    PREDICTOR_REPLIES,
    PREDICTOR_REQUESTS,
    Cancel,
    Codec,
    DecoderInfo,
    Done,
    Error,
    Heartbeat,
    Load,
    Loaded,
    LoadFailed,
    Message,
    PeerRestarted,
    ProcStatus,
    Queued,
    Ranking,
    Ready,
    Shutdown,
    SlotStatus,
    Snapshot,
    Status,
    StatusRequest,
    Submit,
    Tokens,
    encode,
)
from memspec.common.metrics import IterationRecord, LoadEvent, RunStats, Summary, Trace

DRAFTS = ["general", "code", "math", "law", "medical"]
STARTUP = {"process": 1.21, "config": 0.01, "verify": 0.0, "native": 0.01, "tokenizer": 0.74,
           "target": 0.31, "engine": 0.0, "drafts": 0.04, "slots": 0.01, "edge_profile": 0.0,
           "calibration": 0.0, "ready": 0.0}  # a decoder's start-up split (startup.py)


def _stats(iterations: int = 64, traced: bool = False) -> Summary:
    st = RunStats(prompt_tokens=40)
    for i in range(iterations):
        st.records.append(IterationRecord(DRAFTS[i % 2], 4, i % 5, 1 + i % 5, 0.01 * i,
                                          t_draft=0.004, t_verify=0.006))
    out = st.report()
    out.policy, out.resident_at_end = "memspec", ["general", "code"]
    if traced:
        loads = [LoadEvent(0.1 * i, "loaded", DRAFTS[i % 5], i % 2, 0.4, 0.001)
                 for i in range(8)]
        out.trace = Trace(st.records, loads, 0.05, 0.02)
    return out


def samples() -> dict[str, tuple[Message, Codec]]:
    """Each message type, and the codec of the socket that receives it."""
    slots = [SlotStatus(i, 3 + i, "resident", d) for i, d in enumerate(DRAFTS[:2])]
    procs = {n: ProcStatus(1000 + i, "ready", 0, 512.5, 12.0)
             for i, n in enumerate(("loader", "predictor", "decoder"))}
    procs["decoder"] = ProcStatus(1002, "backoff", 3, 640.0, 24.0, "avx512-bf16", "int4",
                                  crashes=2, backoff_s=0.7, recovery_s=2.4, startup=STARTUP)
    msgs: dict[str, Message] = {
        "Submit": Submit(req_id="a1b2c3d4e5f6", prompt="Write a Python function that "
                         "returns the factorial of n." * 4, max_new_tokens=128),
        # a request the supervisor resumes on a restarted decoder (launch/resume.py)
        "Submit+resume": Submit(req_id="a1b2c3d4e5f6", prompt="Write a Python function "
                                "that returns the factorial of n.", max_new_tokens=128,
                                resume_ids=list(range(1000, 1064)), resume_chars=250),
        "Tokens": Tokens(req_id="a1b2c3d4e5f6", ids=[1, 2, 3], text=" the"),
        "Done": Done(req_id="a1b2c3d4e5f6", text="word " * 128, token_ids=list(range(128)),
                     stats=_stats()),
        "Done+trace": Done(req_id="a1b2c3d4e5f6", text="word " * 128,
                           token_ids=list(range(128)), stats=_stats(traced=True)),
        "Error": Error(req_id="a1b2c3d4e5f6", message="policy 'x' is unknown"),
        "Snapshot": Snapshot(req_id="a1b2c3d4e5f6", seq=7, prompt="Explain the ruling. " * 10,
                             recent_ids=list(range(1000, 1032))),
        "Ranking": Ranking(req_id="a1b2c3d4e5f6", seq=7, drafts=DRAFTS,
                           scores=[0.5, 0.2, 0.1, 0.1, 0.1], latency_s=0.021),
        "Load": Load(slot=1, generation=12, draft="code", path="/m/drafts/code/model.safetensors",
                     transport="shm", handle="memspec-ab12cd34-slot1", capacity=7_400_000,
                     storage="edge-emulated", bandwidth_bytes_s=3.1e6,
                     expected_sha256="ab" * 32),
        "Cancel": Cancel(slot=1, generation=12),
        "Loaded": Loaded(slot=1, generation=12, draft="code", nbytes=7_400_000, seconds=0.41,
                         checksum="ab" * 32),
        "LoadFailed": LoadFailed(slot=1, generation=12, draft="code", reason="cancelled"),
        "Heartbeat": Heartbeat(proc="decoder", pid=1234, state="busy"),
        "Ready": Ready(proc="decoder", pid=1234, info=DecoderInfo(
            load_s=3.2, K=2, transport="shm", slot_bytes=7_400_000, bandwidth_bytes_s=3.1e6,
            handles=["memspec-ab-slot0", "memspec-ab-slot1"], dtype="int4",
            isa="avx512-bf16", startup=STARTUP)),
        "Status": Status(procs=procs, slots=slots),
        "StatusRequest": StatusRequest(),
        "Shutdown": Shutdown(reason="bench"),
        "PeerRestarted": PeerRestarted(proc="loader", pid=4321),
        "Queued": Queued(req_id="a1b2c3d4e5f6", ahead=2),
    }
    codecs = {"Submit": CLIENT_REQUESTS, "Submit+resume": DECODER_REQUESTS,
              "StatusRequest": CLIENT_REQUESTS,
              "Shutdown": DECODER_REQUESTS, "PeerRestarted": DECODER_REQUESTS,
              "Snapshot": PREDICTOR_REQUESTS, "Ranking": PREDICTOR_REPLIES,
              "Load": LOADER_REQUESTS, "Cancel": LOADER_REQUESTS, "Loaded": LOADER_REPLIES,
              "LoadFailed": LOADER_REPLIES, "Heartbeat": CONTROL, "Ready": CONTROL,
              "Queued": CLIENT_REPLIES}
    return {name: (m, codecs.get(name, DECODER_REPLIES)) for name, m in msgs.items()}


def _round_trip(msg: Message, codec: Codec) -> Callable[[], object]:
    def go() -> object:
        return codec.decode(encode(msg))

    return go


def time_per_call(fn: Callable[[], object], budget_s: float = 0.2, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call, each repeat about `budget_s`."""
    n, t = 1, 0.0
    while t < budget_s / 10:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        n *= 2
    n = max(1, int(n * budget_s / max(t, 1e-9) / 2))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return statistics.median(runs)


def measure(budget_s: float = 0.2) -> dict[str, dict[str, float]]:
    out = {}
    for name, (msg, codec) in samples().items():
        size = sum(len(f) for f in encode(msg))
        out[name] = {"us": time_per_call(_round_trip(msg, codec), budget_s) * 1e6,
                     "bytes": size}
    return out


def main_bench_messages(args) -> int:
    res = measure()
    if getattr(args, "json", None):
        from memspec.common.provenance import result_provenance

        with open(args.json, "w") as f:
            json.dump({"provenance": result_provenance(uses_pool=False), **res}, f, indent=2)
    print(f"{'message':<14}{'encode+decode us':>18}{'bytes':>8}")
    for name, r in res.items():
        print(f"{name:<14}{r['us']:>18.2f}{r['bytes']:>8}")
    return 0
