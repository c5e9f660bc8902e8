"""The target's weights as the lean forward holds them, kept so a restart skips quantising.

Quantising SmolLM2-135M into int4 blocks costs a CPU 0.4-2 s at every decoder start, and a
crashed decoder's requests wait for its restart. The blocks depend only on the target's
weight files, the format and the code that makes them, so the first start writes them to
`$MEMSPEC_HOME/prepared/` (one file per target folder and format, the key of what made it
in its metadata, written atomically) and later starts read them instead (tens of ms, and
the float weights are never read). A file whose key differs is rebuilt, never used. It is
trusted as the target's own stamps are (`verified.json`: a file unchanged since its check):
an artefact of `$MEMSPEC_HOME` derived from the target checked against its manifest.

The layers' int4 and int8 projections are kept in the block kernels' own layout
(q4blocks.py, q8blocks.py): the C++ forward points its kernels at them as they are read, so
a start neither quantises nor repacks (SmolLM2-135M on a 2-core AVX2 VM: the native model's
construction 0.51 s -> ~0.05 s), and the file holds 4 bits a weight, not a byte.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from memspec.procs.decoder.forward import q4blocks, q8blocks
from memspec.procs.decoder.forward.lean import Arch, LeanLayer, LeanLM
from memspec.procs.decoder.forward.linear import DenseLinear, Int4Linear, Int8Linear, Linear
from memspec.procs.decoder.forward.q4blocks import PackedInt4Linear
from memspec.procs.decoder.forward.q8blocks import PackedInt8Linear

FORMAT = "memspec-prepared/3"  # /3: the int8 LM head packed
CACHED_FORMATS = ("int4", "int8")  # the formats that cost a quantisation
_CODE = [Path(__file__).resolve().parent / n
         for n in ("ggml.py", "lean.py", "linear.py", "prepared.py", "q4blocks.py", "q8blocks.py")]
LOG = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
# packed blocks (a layer's, an int8 LM head's): the C++ forward copies them into huge pages
_PACKED_PART = re.compile(r"^(l\d+\.\w+|lm_head)\.(q4[ndm]|q8[wdcs])$")


def cache_key(model_dir: Path, fmt: str, act_dtype: torch.dtype) -> str:
    """Everything the prepared weights depend on: format, activation dtype, torch, the
    target's weight files (size, mtime, inode) and config, and the code that builds them."""
    h = hashlib.sha256()
    for part in (FORMAT, fmt, str(act_dtype), torch.__version__, str(Path(model_dir).resolve())):
        h.update(part.encode())
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    h.update((Path(model_dir) / "config.json").read_bytes())
    for f in _CODE:
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


def cache_path(home: Path, model_dir: Path, fmt: str) -> Path:
    folder = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:12]
    return home / "prepared" / f"{Path(model_dir).name}-{folder}-{fmt}.safetensors"


def lean_target(model_dir: Path, arch: Arch, fmt: str, act_dtype: torch.dtype,
                build: Callable[[], LeanLM], home: Path) -> LeanLM:
    """The fused lean model of the target in `fmt`: from the cache when it holds this key,
    else `build()` and cached (a read-only home only skips the cache)."""
    if fmt not in CACHED_FORMATS:
        return build()
    key = cache_key(model_dir, fmt, act_dtype)
    path = cache_path(home, model_dir, fmt)
    lean = _read(path, key, arch, act_dtype)
    if lean is not None:
        return lean
    lean = build()
    try:
        _write(path, key, lean)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs only time
        LOG.warning(f"prepared weights not cached in {path.parent} ({type(exc).__name__}: "
                    f"{str(exc)[:120]}); the target is quantised at every start")
    return lean


def _linear(name: str, lin: Linear, out: Tensors, kinds: dict[str, str],
            packed: bool = True) -> None:
    """One layer's tensors into `out` (`packed`: int4 / int8 blocks in the kernels' layout
    where they tile)."""
    if packed and isinstance(lin, Int4Linear) and (
            isinstance(lin, PackedInt4Linear) or q4blocks.packable(tuple(lin.q.shape))):
        kinds[name] = "q4blocks"
        parts = lin.parts if isinstance(lin, PackedInt4Linear) else q4blocks.pack_blocks(lin)
        out.update({f"{name}.{p}": parts[p] for p in q4blocks.PARTS})
    elif packed and isinstance(lin, Int8Linear) and (
            isinstance(lin, PackedInt8Linear) or q8blocks.packable(tuple(lin.q.shape))):
        kinds[name] = "q8blocks"
        parts = lin.parts if isinstance(lin, PackedInt8Linear) else q8blocks.pack_blocks(lin)
        out.update({f"{name}.{p}": parts[p] for p in q8blocks.PARTS})
    elif isinstance(lin, Int4Linear):
        kinds[name] = "int4"
        out.update({f"{name}.q": lin.q, f"{name}.d": lin.d, f"{name}.m": lin.m})
    elif isinstance(lin, Int8Linear):
        kinds[name] = "int8"
        out.update({f"{name}.q": lin.q, f"{name}.d": lin.d})
    elif isinstance(lin, DenseLinear):
        kinds[name] = "dense"
        out[f"{name}.weight"] = lin.weight
    else:
        raise TypeError(f"{type(lin).__name__} is not a cached weight format")
    if lin.bias is not None:
        out[f"{name}.bias"] = lin.bias


def _unlinear(name: str, kind: str, t: Tensors, act_dtype: torch.dtype) -> Linear:
    bias = t.get(f"{name}.bias")
    if kind == "q4blocks":
        return PackedInt4Linear({p: t[f"{name}.{p}"] for p in q4blocks.PARTS}, act_dtype, bias)
    if kind == "q8blocks":
        return PackedInt8Linear({p: t[f"{name}.{p}"] for p in q8blocks.PARTS}, act_dtype, bias)
    if kind == "int4":
        return Int4Linear.from_blocks(t[f"{name}.q"], t[f"{name}.d"], t[f"{name}.m"],
                                      act_dtype, bias)
    if kind == "int8":
        return Int8Linear.from_blocks(t[f"{name}.q"], t[f"{name}.d"], act_dtype, bias)
    if kind == "dense":
        return DenseLinear(t[f"{name}.weight"], bias)
    raise KeyError(f"unknown kind {kind!r}")


def _write(path: Path, key: str, lean: LeanLM) -> None:
    from safetensors.torch import save_file

    out: Tensors = {}
    kinds: dict[str, str] = {}
    counts = []
    for i, layer in enumerate(lean.layers):
        out[f"l{i}.ln1"], out[f"l{i}.ln2"] = layer.ln1, layer.ln2
        for j, lin in enumerate(layer.qkv):
            _linear(f"l{i}.qkv{j}", lin, out, kinds)
        _linear(f"l{i}.o", layer.o, out, kinds)
        for j, lin in enumerate(layer.gate_up):
            _linear(f"l{i}.gu{j}", lin, out, kinds)
        _linear(f"l{i}.down", layer.down, out, kinds)
        counts.append([len(layer.qkv), len(layer.gate_up)])
    head = lean.lm_head
    # an int8 LM head packed like the layers (the embedding, when tied, and draft heads'
    # vocabularies read its rows from the packed copy: one copy, no repacking at start)
    _linear("lm_head", head, out, kinds, packed=isinstance(head, Int8Linear))
    # tied ends share the LM head's tensors (int8 rows and scales, or dense rows)
    tied = getattr(head, "q", getattr(head, "weight", None))
    embed = "lm_head" if lean.embed_w is tied else "embed"
    if embed == "embed":
        out["embed"] = lean.embed_w
    scale = "none" if lean.embed_scale is None else (
        "lm_head" if lean.embed_scale is getattr(head, "d", None) else "embed_scale")
    if scale == "embed_scale":
        out["embed_scale"] = lean.embed_scale
    out["norm"] = lean.norm
    meta = {"format": FORMAT, "key": key, "kinds": json.dumps(kinds),
            "layers": json.dumps(counts), "embed": embed, "embed_scale": scale}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, key: str, arch: Arch, act_dtype: torch.dtype) -> LeanLM | None:
    """The cached model, or None when there is none for this key or it does not read."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("key") != key:
                return None
            names = f.keys()  # (a safe_open handle is not iterable)
            # get_tensor gives views of one mapping of the whole file: a view kept alive
            # keeps every page read through it counted in the process (~94 MB for the demo
            # target). The layers' packed blocks are copied once more by the C++ forward
            # (into huge pages) and then dropped; everything else is copied out here, so
            # the mapping goes once the model is built.
            t = {k: f.get_tensor(k) if _PACKED_PART.search(k) else f.get_tensor(k).clone()
                 for k in names}
        kinds = json.loads(meta["kinds"])
        counts = json.loads(meta["layers"])
        if len(counts) != arch.layers:
            return None
        layers = [LeanLayer(ln1=t[f"l{i}.ln1"], ln2=t[f"l{i}.ln2"],
                         qkv=[_unlinear(f"l{i}.qkv{j}", kinds[f"l{i}.qkv{j}"], t, act_dtype)
                              for j in range(nq)],
                         o=_unlinear(f"l{i}.o", kinds[f"l{i}.o"], t, act_dtype),
                         gate_up=[_unlinear(f"l{i}.gu{j}", kinds[f"l{i}.gu{j}"], t, act_dtype)
                                  for j in range(ng)],
                         down=_unlinear(f"l{i}.down", kinds[f"l{i}.down"], t, act_dtype))
                  for i, (nq, ng) in enumerate(counts)]
        head = _unlinear("lm_head", kinds["lm_head"], t, act_dtype)
        if isinstance(head, PackedInt8Linear) and meta["embed"] == "lm_head":
            embed = scale = None  # tied: the head's own rows (LeanLM.tied_rows)
        else:
            embed = getattr(head, "q", getattr(head, "weight", None)) \
                if meta["embed"] == "lm_head" else t["embed"]
            # (a packed head's d is read only where it is the embedding's: reading it unpacks)
            kind = meta["embed_scale"]
            scale = None if kind == "none" else head.d if kind == "lm_head" else \
                t["embed_scale"]
        return LeanLM(arch, embed, layers, t["norm"], head, act_dtype, scale)
    except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
        LOG.warning(f"prepared weights {path} unreadable ({type(exc).__name__}); rebuilding")
        return None
