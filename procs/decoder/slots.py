"""Slot memory: fixed-capacity byte buffers that draft weights live in as views.

A draft is never allocated on its own: its module is built on the ``meta`` device and its
parameters are assigned typed views into a slot. Replacing a draft rewrites the slot's
bytes; the buffer itself is allocated once, which is what lets a loader process fill it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memspec.common.draftfiles import draft_weights_file
from memspec.common.errors import ModelError
from memspec.common.safetensors_layout import Layout, read_layout, views_into
from memspec.procs.decoder.drafts.datastore import (
    DATASTORE_KIND,
    Datastore,
    StoreRunner,
    read_store_config,
    store_params,
)
from memspec.procs.decoder.drafts.head import (
    HEAD_KIND,
    HeadRunner,
    TargetParts,
    is_head,
    read_head_config,
    scored_rows,
)
from memspec.procs.decoder.forward.checkpoint import lean_arch, materialise_buffers
from memspec.procs.decoder.forward.cudagraph import GraphLM
from memspec.procs.decoder.forward.lean import KVCache, LeanLM, alloc_cache, projection_shapes
from memspec.procs.decoder.forward.native import NativeLM
from memspec.procs.decoder.forward.quantized import (
    QuantFormat,
    dequantized,
    quant_format,
    quantized_lean,
)
from memspec.procs.decoder.forward.runners import HFRunner, Runner, accelerate, default_act_dtype

META_PREFIX = "memspec."  # tensors in a draft file that are ours, not the model's
ID_MAP_KEY = "memspec.draft_to_target"  # draft vocab index -> target token id
CHUNK = 4 << 20


class SlotBuffer:
    """One fixed block of bytes, allocated once; ``generation`` counts rewrites."""

    def __init__(self, capacity: int, device: str | torch.device = "cpu",
                 data: torch.Tensor | None = None) -> None:
        self.data = data if data is not None else torch.empty(capacity, dtype=torch.uint8,
                                                              device=device)
        self.capacity = self.data.numel()
        self.generation = 0
        self.draft: str | None = None
        self._kv: KVCache | None = None

    def kv_cache(self, model: LeanLM | NativeLM | GraphLM | HeadRunner, capacity: int
                 ) -> KVCache:
        """The static KV cache of the draft this slot holds: allocated once, reused by every
        later draft of the same shape (a rollback or a new request is a length change)."""
        a = getattr(model, "cache_arch", model.arch)
        dtype = model.cache_dtype or model.act_dtype
        kv = self._kv
        if kv is None or kv.v.shape[:2] + kv.v.shape[3:] != (a.layers, a.kv_heads, a.head_dim) \
                or kv.capacity < capacity or kv.k.dtype != dtype \
                or kv.k_blocked != model.k_blocked:
            kv = self._kv = alloc_cache(a, capacity, dtype, model.device, model.k_blocked)
        return kv

    def fill_from_file(self, layout: Layout) -> int:
        """Copy the file's data section verbatim (in-process path; the loader process streams)."""
        if layout.data_size > self.capacity:
            raise ModelError(
                f"{layout.path.parent.name} needs {layout.data_size / 2**20:.1f} MB but a slot "
                f"holds {self.capacity / 2**20:.1f} MB", "raise the slot capacity")
        with layout.path.open("rb") as f:
            f.seek(layout.data_offset)
            done = 0
            while done < layout.data_size:
                chunk = f.read(min(CHUNK, layout.data_size - done))
                if not chunk:
                    raise ModelError(f"{layout.path} is truncated", "rebuild or re-copy it")
                src = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                self.data[done:done + len(chunk)].copy_(src)
                done += len(chunk)
        self.generation += 1
        return done


@dataclass
class BoundDraft:
    """A draft whose weights are views into a slot, plus its vocabulary map.

    ``runner`` is what the hot loop calls: the lean forward over the slot's views when the
    architecture has one, else the HF module. ``model`` (an HF module over the same views)
    is built on first use, for offline tools such as teacher-forced acceptance tables.
    """

    name: str
    runner: Runner
    slot: SlotBuffer
    generation: int
    to_target: torch.Tensor | None  # [V_draft] target ids, None: same vocabulary
    to_draft: torch.Tensor | None  # [V_target] draft ids (unknown -> 0)
    config: Any = None
    weights: dict[str, torch.Tensor] | None = None

    @property
    def kind(self) -> str:
        if isinstance(self.runner, StoreRunner):
            return DATASTORE_KIND
        return HEAD_KIND if isinstance(self.runner, HeadRunner) else "model"

    def new_cache(self, capacity: int) -> Any:
        if isinstance(self.runner, (LeanLM, NativeLM, GraphLM, HeadRunner)):
            return self.slot.kv_cache(self.runner, capacity)
        return self.runner.new_cache(capacity)

    @property
    def model(self) -> nn.Module:
        if isinstance(self.runner, HFRunner):
            return self.runner.model
        if self.weights is None or self.config is None:
            raise ModelError(f"draft '{self.name}' has no HF module", "bind it again")
        return _hf_module(self.name, self.config, self.weights, self.slot.data.device)


def _hf_module(name: str, config: Any, weights: dict[str, torch.Tensor],
               device: torch.device) -> nn.Module:
    """The draft as an HF module whose parameters are the given slot views (no copy)."""
    from transformers import AutoModelForCausalLM  # model drafts only: a head pool skips it

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        raise ModelError(f"draft '{name}' weights do not match its config (tensor {bad})",
                         "rebuild the draft's model.safetensors from its config")
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    materialise_buffers(model, device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ModelError(f"draft '{name}' has unbound parameter {leftover[0]}",
                         "rebuild the draft's weight file")
    return model.eval()


def _lean_runner(name: str, config: Any, weights: dict[str, torch.Tensor]) -> LeanLM | None:
    """The lean forward over the slot views (dense, in the file's dtype: no copy)."""
    arch = lean_arch(config.to_dict())
    if arch is None:
        return None
    dtype = weights["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in \
        weights else torch.float32
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    fmt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    try:
        return LeanLM.from_weights(arch, weights, fmt, dtype, fuse=False)
    except ModelError as exc:
        raise ModelError(f"draft '{name}' weights do not match its config ({exc.problem})",
                         "rebuild the draft's model.safetensors from its config") from None


def _quantized_runner(name: str, qfmt: QuantFormat, config: Any,
                      weights: dict[str, torch.Tensor], device: torch.device) -> Runner:
    """A GPTQ / AWQ draft: int4 blocks on a CPU (as a target's), else its exact dequantised
    weights in bf16 (GPUs have no int4 kernel here) or fp32 (architectures without a lean
    forward)."""
    arch = lean_arch(config.to_dict())
    try:
        if arch is not None and device.type == "cpu":
            return accelerate(quantized_lean(qfmt, arch, weights, default_act_dtype(device)))
        dense = dequantized(qfmt, projection_shapes(arch) if arch else None, weights)
        if arch is not None:
            dense = {k: v.to(torch.bfloat16) for k, v in dense.items()}
            return accelerate(LeanLM.from_weights(arch, dense, "bfloat16", torch.bfloat16,
                                                  fuse=False))
    except ModelError as exc:
        raise ModelError(f"draft '{name}': {exc.problem}", exc.fix) from None
    plain = type(config).from_dict({k: v for k, v in config.to_dict().items()
                                    if k != "quantization_config"})
    return HFRunner(_hf_module(name, plain, dense, device))


def bind_draft(name: str, model_dir: Path, slot: SlotBuffer, layout: Layout | None = None,
               config=None, target_vocab: int | None = None,
               parts: TargetParts | None = None) -> BoundDraft:
    """Point a draft's forward at the slot's bytes: views, never copies. A head draft also
    needs ``parts``: what it reads from the resident target."""
    model_dir = Path(model_dir)
    layout = layout or read_layout(draft_weights_file(model_dir))
    views = views_into(slot.data, layout)
    weights = {k: v for k, v in views.items() if not k.startswith(META_PREFIX)}
    to_target = views.get(ID_MAP_KEY)
    if to_target is not None:
        to_target = to_target.to(torch.long)
        if target_vocab is not None and int(to_target.max()) >= target_vocab:
            raise ModelError(f"draft '{name}' maps to token ids beyond the target's "
                             f"vocabulary of {target_vocab}", "rebuild it for this target")
    store_cfg = read_store_config(model_dir)
    if store_cfg.get("memspec_kind") == DATASTORE_KIND:  # tables, not weights: numpy views
        try:  # of the slot's bytes
            store = Datastore({k: v.cpu().numpy() for k, v in weights.items()},
                              store_params(store_cfg))
        except ValueError as exc:
            raise ModelError(f"datastore '{name}': {exc}",
                             "rebuild it with `memspec zoo stores`") from None
        return BoundDraft(name, StoreRunner(store), slot, slot.generation, None, None,
                          store_cfg, weights)
    if is_head(model_dir):
        arch, config = read_head_config(model_dir)
        if parts is None:
            raise ModelError(f"draft '{name}' is a head and needs the target to run",
                             "bind it through an engine (SpecEngine.target_parts)")
        if to_target is None or to_target.numel() != arch.vocab:
            raise ModelError(f"head '{name}' has no draft-vocabulary id map of {arch.vocab}",
                             "rebuild the head with `memspec zoo drafts`")
        to_target = scored_rows(to_target)
        arch = replace(arch, vocab=to_target.numel())
        runner: Runner = HeadRunner(name, arch, weights, parts, to_target)
        return BoundDraft(name, runner, slot, slot.generation, to_target,
                          draft_index(to_target, target_vocab), config, weights)
    if config is None:
        from transformers import AutoConfig  # model drafts only: a head pool skips it

        config = AutoConfig.from_pretrained(model_dir)
    qfmt = quant_format(model_dir, config.to_dict())
    if qfmt is not None:  # GPTQ / AWQ: blocks unpacked out of the slot (not views)
        runner = _quantized_runner(name, qfmt, config, weights, slot.data.device)
        to_draft = draft_index(to_target, target_vocab) if to_target is not None else None
        return BoundDraft(name, runner, slot, slot.generation, to_target, to_draft, config)
    lean = _lean_runner(name, config, weights)
    if lean is not None:
        if lean.vocab != weights["model.embed_tokens.weight"].shape[0]:
            raise ModelError(f"draft '{name}' weights do not match its config (vocab)",
                             "rebuild the draft's model.safetensors from its config")
        runner = accelerate(lean)
    else:
        runner = HFRunner(_hf_module(name, config, weights, slot.data.device))
    to_draft = draft_index(to_target, target_vocab) if to_target is not None else None
    return BoundDraft(name, runner, slot, slot.generation, to_target, to_draft, config, weights)


def draft_index(to_target: torch.Tensor, target_vocab: int | None) -> torch.Tensor:
    """Target id -> draft id (ids outside the draft vocabulary -> 0)."""
    vocab = max(target_vocab or 0, int(to_target.max()) + 1)
    to_draft = torch.zeros(max(vocab, 1), dtype=torch.long, device=to_target.device)
    to_draft[to_target] = torch.arange(to_target.numel(), device=to_target.device)
    return to_draft


def load_into_slot(name: str, model_dir: Path, slot: SlotBuffer,
                   target_vocab: int | None = None, parts: TargetParts | None = None
                   ) -> BoundDraft:
    """In-process load: copy the file into the slot, then bind (engine tests, `generate`)."""
    layout = read_layout(draft_weights_file(model_dir))
    slot.fill_from_file(layout)
    slot.draft = name
    return bind_draft(name, model_dir, slot, layout, target_vocab=target_vocab, parts=parts)
