"""Per-iteration records and the run metrics of ARCHITECTURE.md §6 (vLLM names where they exist).

Pure bookkeeping: the engine, the multi-process runtime and the replay simulator all
produce :class:`IterationRecord` lists and summarise them the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class IterationRecord:
    """One decode iteration: a draft proposes, the target verifies (or a target-only step)."""

    draft: str | None  # None: target-only step
    proposed: int
    accepted: int
    emitted: int  # tokens committed by this iteration
    t_start: float
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_catchup: float = 0.0
    desired: bool = True  # False: fallback execution (preferred draft not resident)
    catchup_tokens: int = 0  # tokens the draft's KV cache had to prefill on (re)activation

    @property
    def duration(self) -> float:
        return self.t_draft + self.t_verify + self.t_catchup


@dataclass
class RunStats:
    """Everything one request produced besides its tokens."""

    records: list[IterationRecord] = field(default_factory=list)
    t_prefill: float = 0.0
    t_load_wait: float = 0.0
    t_prediction: float = 0.0
    t_e2e: float = 0.0
    loads: int = 0
    evictions: int = 0
    switches: int = 0
    bytes_loaded: int = 0
    prompt_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        """The §6 metrics under their public names."""
        recs = self.records
        drafted = [r for r in recs if r.draft is not None]
        num_drafts = len(drafted)
        num_draft_tokens = sum(r.proposed for r in drafted)
        num_accepted = sum(r.accepted for r in drafted)
        generated = sum(r.emitted for r in recs)
        t_draft = sum(r.t_draft for r in recs)
        t_verify = sum(r.t_verify for r in recs)
        t_catchup = sum(r.t_catchup for r in recs)
        t_desired = sum(r.duration for r in recs if r.desired)
        # §6: fallback = a non-preferred *resident draft* runs while the preferred one loads;
        # the target alone while nothing preferred is resident (cold start) is kept apart
        t_fallback = sum(r.duration for r in recs if not r.desired and r.draft is not None)
        t_target_fb = sum(r.duration for r in recs if not r.desired and r.draft is None)
        t_decode = t_desired + t_fallback + t_target_fb + self.t_load_wait + self.t_prediction
        return {
            "generated_tokens": generated,
            "prompt_tokens": self.prompt_tokens,
            "iterations": len(recs),
            "tokens_per_s_steady": generated / t_decode if t_decode > 0 else 0.0,
            "tokens_per_s_e2e": generated / self.t_e2e if self.t_e2e > 0 else 0.0,
            "num_drafts": num_drafts,
            "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted,
            "mean_acceptance_length": 1.0 + num_accepted / num_drafts if num_drafts else 1.0,
            "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            "time": {
                "prefill": self.t_prefill,
                "draft": t_draft,
                "verify": t_verify,
                "catchup": t_catchup,
                "desired": t_desired,
                "fallback": t_fallback,
                "target_fallback": t_target_fb,
                "load_wait": self.t_load_wait,
                "prediction": self.t_prediction,
                "decode": t_decode,
                "e2e": self.t_e2e,
            },
            "loads": self.loads,
            "evictions": self.evictions,
            "switches": self.switches,
            "bytes_loaded": self.bytes_loaded,
            "drafts_used": dict(Counter(r.draft for r in drafted)),
        }

    def records_as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]
