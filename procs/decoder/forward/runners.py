"""One forward interface for the engine: the lean Llama-family model or any HF causal LM.

A runner computes logits for ``ids`` at positions ``pos..pos+T-1`` over a cache that the
caller owns, and the caller tracks how much of that cache is valid: the lean model writes
K/V in place into a static cache (rollback is free), while :class:`HFRunner` keeps a
``DynamicCache`` and crops it lazily to ``pos``, so architectures the lean forward does not
cover still decode losslessly through the same engine.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

import torch

from memspec.common.isa import bf16_native
from memspec.procs.decoder.forward.cudagraph import GraphLM
from memspec.procs.decoder.forward.lean import LeanLM
from memspec.procs.decoder.forward.native import accelerate as native_accelerate
from memspec.procs.decoder.forward.quantized import needs_gather

if TYPE_CHECKING:  # imported where an HF model runs: a lean target's decoder starts without it
    from transformers import DynamicCache

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_BIT = ("int8", "int4")
DTYPES = ("auto", *FLOAT_DTYPES, *LOW_BIT)


class Runner(Protocol):
    vocab: int
    device: torch.device

    def new_cache(self, capacity: int) -> Any: ...

    def forward(self, ids: torch.Tensor, pos: int, cache: Any,
                last_only: bool = False) -> torch.Tensor: ...


_CACHE_KW: dict[type, str] = {}


def forward_with_cache(model: torch.nn.Module, ids: torch.Tensor, cache: DynamicCache, **kw):
    """Call an HF causal LM with a KV cache under whichever keyword its version takes."""
    key = _CACHE_KW.get(type(model))
    if key is None:
        params = inspect.signature(model.forward).parameters
        key = _CACHE_KW[type(model)] = "cache" if "cache" in params else "past_key_values"
    return model(ids, use_cache=True, **{key: cache}, **kw)


class HFRunner:
    """Any HF causal LM (eager, ``DynamicCache``): the reference path and the fallback."""

    feature_layers: list[int] = []

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    def new_cache(self, capacity: int) -> DynamicCache:
        from transformers import DynamicCache

        cache = DynamicCache()
        hidden = int(self.model.config.hidden_size)
        cache.feat = torch.zeros(capacity, len(self.feature_layers) * hidden,
                                 device=self.device) if self.feature_layers else None
        return cache

    def forward(self, ids: torch.Tensor, pos: int, cache: DynamicCache,
                last_only: bool = False) -> torch.Tensor:
        held = cache.get_seq_length()
        if held > pos:
            cache.crop(pos - held)  # negative: tokens to remove (transformers 4 and 5)
        elif held < pos:
            raise RuntimeError(f"KV cache holds {held} tokens, forward starts at {pos}")
        feat = getattr(cache, "feat", None)
        kw: dict = {"logits_to_keep": 1} if last_only else {}
        if feat is not None:
            kw["output_hidden_states"] = True
        out = forward_with_cache(self.model, ids.view(1, -1), cache, **kw)
        if feat is not None:
            T, h = ids.numel(), int(self.model.config.hidden_size)
            for j, layer in enumerate(self.feature_layers):
                feat[pos:pos + T, j * h:(j + 1) * h] = out.hidden_states[layer + 1][0].float()
        return out.logits[0]


def set_feature_layers(runner: Runner, layers: list[int]) -> None:
    """Make the runner's caches keep features of ``layers`` (caches made before are dropped
    so the next one has room for them)."""
    lean = getattr(runner, "lean", runner)
    lean.feature_layers = list(layers)
    if hasattr(lean, "_cache"):
        lean._cache = None
    if hasattr(runner, "_cache"):
        runner._cache = None
    if hasattr(runner, "_graphs"):
        runner._graphs.clear()


def as_runner(model: Runner | torch.nn.Module) -> Runner:
    return HFRunner(model) if isinstance(model, torch.nn.Module) else model


def accelerate(lean: LeanLM, enabled: bool = True) -> Runner:
    """The fastest forward for the model's device: the C++ forward on CPUs (when it can be
    built), CUDA graphs on GPUs; ``enabled=False`` keeps the plain PyTorch forward."""
    if not enabled:
        return lean
    if lean.device.type == "cuda":
        return GraphLM(lean)
    if needs_gather(lean):  # act-order GPTQ layers: the C++ forward has no input gather
        return lean
    return native_accelerate(lean)


def default_act_dtype(device: torch.device) -> torch.dtype:
    """Activations of the PyTorch forward for low-bit weights: bf16 where the chosen kernel
    path has native bf16 (``memspec.common.isa``: one probe for every part), else fp32."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if bf16_native() else torch.float32
