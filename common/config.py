"""Pool config (``pool.toml``): target, drafts and scheduling knobs, validated up front.

Every problem becomes a :class:`ConfigError` whose message names the field and the fix,
so a bad file fails at start with one line instead of deep inside a process.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6, Ubuntu 22.04): the same parser, as a package
    import tomli as tomllib

from memspec.common.errors import ConfigError, RequestError
from memspec.common.paths import (
    DEFAULT_POOL,
    TARGET_DIRNAME,
    converted_gguf_folder,
    default_target_dir,
    expand_path,
)
from memspec.common.tuned import knob

POLICIES = (
    "target-only",
    "lookup-only",
    "general-static",
    "oracle-static",
    "mab-sync",
    "mab-async",
    "prediction-only",
    "memspec",
    "oracle-dynamic",
)
ORACLE_POLICIES = ("oracle-static", "oracle-dynamic")  # they read the pool's traced tables
STORAGE_PROFILES = ("native", "edge-emulated")
# target precision: auto = fastest on the device (procs/decoder/forward/precision.py)
TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
_POOL_KEYS = {
    "target", "K", "gamma", "N", "T", "policy", "storage", "general",
    "memory_budget_mb", "load_iter_ratio", "bandwidth_mb_s", "ucb_c", "predictor_head",
    "max_new_tokens", "dtype", "max_context", "spec_gate", "lookup", "rank_horizon",
}
_DRAFT_KEYS = {"name", "domain", "path", "kind", "description"}
# model: an independent causal LM sharing the tokenizer; head: a one-layer head over the
# target's features (procs/decoder/drafts/head.py)
DRAFT_KINDS = ("model", "head", "datastore")
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts (unsigned)


@dataclass(frozen=True)
class DraftSpec:
    name: str
    domain: str
    path: Path
    kind: str = "model"
    description: str = ""  # what the draft is good at: the fallback ranking reads it


@dataclass(frozen=True)
class PoolConfig:
    target: Path
    drafts: tuple[DraftSpec, ...]
    K: int = 2
    gamma: int = 4
    N: int = 4
    T: int = 32
    policy: str = "memspec"
    storage: str = "native"
    general: str = "general"
    max_new_tokens: int = 128
    dtype: str = "auto"
    max_context: int = 2048  # static KV caches hold this many positions
    memory_budget_mb: float | None = None
    load_iter_ratio: float = 2.7
    bandwidth_mb_s: float | None = None
    ucb_c: float = knob("pool.ucb_c")  # `memspec bench tune` (tuned.json)
    spec_gate: bool = True  # memspec / prediction-only run the target alone when no draft pays
    lookup: int = knob("pool.lookup")  # greedy: a context suffix of >= this many tokens seen before proposes
    # what followed it, in place of the draft's guess (procs/decoder/drafts/lookup.py); 0: off
    predictor_head: Path | None = None
    # tokens still to come for a ranking to be worth asking for (None: the tuned
    # gate.RANK_HORIZON, chosen on the heads pool): what a right choice gains per token
    # depends on how much the pool's drafts differ, so a pool may set its own (dev sweep)
    rank_horizon: int | None = None
    K_from_budget: bool = False  # K was not given: derive it from memory_budget_mb
    source: Path | None = field(default=None, compare=False)

    def draft(self, name: str) -> DraftSpec:
        for d in self.drafts:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.drafts) or "none"
        raise ConfigError(f"unknown draft '{name}'", f"pick one of: {known}")

    @property
    def general_draft(self) -> DraftSpec:
        return self.draft(self.general)


def _int_field(raw: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"pool.{key} must be an integer, got {value!r}", f"set {key} = {default}")
    if value < minimum:
        raise ConfigError(f"pool.{key} = {value} is below {minimum}", f"set {key} >= {minimum}")
    return value


def _float_field(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"pool.{key} must be a positive number, got {value!r}", f"fix {key}")
    return float(value)


def _bool_field(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"pool.{key} must be true or false, got {value!r}", f"fix {key}")
    return value


def _choice(raw: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise ConfigError(f"unknown {key} '{value}'", f"use one of: {', '.join(allowed)}")
    return value


def _parse_drafts(items: Any, base: Path) -> tuple[DraftSpec, ...]:
    if not isinstance(items, list):
        raise ConfigError("drafts must be an array of tables", "write [[drafts]] sections")
    drafts: list[DraftSpec] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"drafts[{i}] is not a table", "write it as a [[drafts]] section")
        extra = set(item) - _DRAFT_KEYS
        if extra:
            raise ConfigError(f"drafts[{i}] has unknown field '{sorted(extra)[0]}'",
                              "allowed fields: " + ", ".join(sorted(_DRAFT_KEYS)))
        for key in ("name", "path"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ConfigError(f"drafts[{i}].{key} is missing", f"give each draft a {key}")
        name = item["name"]
        if any(d.name == name for d in drafts):
            raise ConfigError(f"draft name '{name}' is used twice", "give each draft a unique name")
        domain = item.get("domain", name)
        if not isinstance(domain, str):
            raise ConfigError(f"drafts[{i}].domain must be a string", "e.g. domain = \"code\"")
        kind = item.get("kind", "model")
        if kind not in DRAFT_KINDS:
            raise ConfigError(f"draft '{name}' has unknown kind {kind!r}",
                              'use kind = "model", "head" or "datastore"')
        description = item.get("description", "")
        if not isinstance(description, str):
            raise ConfigError(f"drafts[{i}].description must be a string",
                              "e.g. description = \"Python code and its documentation\"")
        drafts.append(DraftSpec(name=name, domain=domain, path=expand_path(item["path"], base),
                                kind=kind, description=description))
    return tuple(drafts)


def parse_pool(data: dict[str, Any], base: Path, source: Path | None = None) -> PoolConfig:
    """Validate a parsed TOML document; paths are not touched here (see :func:`check_paths`)."""
    raw = data.get("pool", {})
    if not isinstance(raw, dict):
        raise ConfigError("[pool] must be a table", "see pool.toml in the repository")
    extra = set(data) - {"pool", "drafts"}
    if extra:
        raise ConfigError(f"unknown top-level section '{sorted(extra)[0]}'",
                          "only [pool] and [[drafts]] are allowed")
    extra = set(raw) - _POOL_KEYS
    if extra:
        raise ConfigError(f"unknown field pool.{sorted(extra)[0]}",
                          f"allowed fields: {', '.join(sorted(_POOL_KEYS))}")
    if not isinstance(raw.get("target"), str):
        raise ConfigError("pool.target is missing", "set target = \"<path to an HF model dir>\"")
    drafts = _parse_drafts(data.get("drafts", []), base)
    names = [d.name for d in drafts]
    # general-static's draft: "general" when there is one, else the first listed
    general = raw.get("general", "general" if "general" in names or not names else names[0])
    policy = _choice(raw, "policy", "memspec", POLICIES)
    if drafts and not any(d.name == general for d in drafts):
        names = ", ".join(d.name for d in drafts)
        raise ConfigError(f"pool.general = '{general}' names no draft",
                          f"set general to one of: {names}")
    head = raw.get("predictor_head")
    return PoolConfig(
        target=expand_path(raw["target"], base),
        drafts=drafts,
        K=_int_field(raw, "K", 2, 1),
        gamma=_int_field(raw, "gamma", 4, 1),
        N=_int_field(raw, "N", 4, 1),
        T=_int_field(raw, "T", 32, 0),
        policy=policy,
        storage=_choice(raw, "storage", "native", STORAGE_PROFILES),
        general=general,
        max_new_tokens=_int_field(raw, "max_new_tokens", 128, 1),
        dtype=_choice(raw, "dtype", "auto", TARGET_DTYPES),
        max_context=_int_field(raw, "max_context", 2048, 16),
        memory_budget_mb=_float_field(raw, "memory_budget_mb", None),
        load_iter_ratio=_float_field(raw, "load_iter_ratio", 2.7) or 2.7,
        bandwidth_mb_s=_float_field(raw, "bandwidth_mb_s", None),
        ucb_c=_float_field(raw, "ucb_c", knob("pool.ucb_c")) or knob("pool.ucb_c"),
        spec_gate=_bool_field(raw, "spec_gate", True),
        lookup=_int_field(raw, "lookup", knob("pool.lookup"), 0),
        predictor_head=expand_path(head, base) if isinstance(head, str) else None,
        rank_horizon=_int_field(raw, "rank_horizon", 0, 0) if "rank_horizon" in raw else None,
        K_from_budget="K" not in raw and "memory_budget_mb" in raw,
        source=source,
    )


def load_pool(path: str | Path | None = None, check: bool = True) -> PoolConfig:
    """Read and validate a pool file (default: the repository's embedded ``pool.toml``)."""
    p = Path(path) if path else DEFAULT_POOL
    if not p.is_file():
        raise ConfigError(f"pool file {p} not found", "pass --pool <file> or create pool.toml")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML ({exc})", "fix the syntax at that line") from None
    pool = parse_pool(data, p.resolve().parent, source=p.resolve())
    if pool.target.suffix.lower() == ".gguf":  # a GGUF target: the folder made of it
        pool = replace(pool, target=gguf_target(pool.target))
    if check:
        check_paths(pool)
    return pool


def gguf_target(gguf: Path) -> Path:
    """A pool's GGUF target as its converted folder; the front doors (`memspec generate`,
    `memspec up`) convert it before the processes start, so here it only needs finding."""
    if not gguf.is_file():
        raise ConfigError(f"target GGUF {gguf} not found", "fix pool.target")
    folder = converted_gguf_folder(gguf.resolve())
    if folder is None:
        raise ConfigError(f"target GGUF {gguf} is not converted yet",
                          f"run `memspec zoo target --gguf {gguf}` once")
    return folder


def _tokenizer_identity(model_dir: Path) -> Any:
    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        return None
    data = json.loads(tok.read_text())
    return (data.get("model", {}).get("vocab"), data.get("model", {}).get("merges"),
            [t.get("content") for t in data.get("added_tokens", [])])


FINGERPRINTS = "fingerprints.json"  # in $MEMSPEC_HOME: tokenizer.json stamp -> fingerprint
MAX_FINGERPRINTS = 64


def _stamped_fingerprint(tok: Path) -> str | None:
    """The fingerprint of `tok` (a tokenizer.json) as last computed, while its size, mtime
    and inode are unchanged: parsing and hashing a 2 MB vocabulary costs every start of a
    decoder (a restart included) a quarter of a second."""
    from memspec.common.files import atomic_write_text
    from memspec.common.paths import memspec_home

    st = tok.stat()
    key, stamp = str(tok.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
    path = memspec_home() / FINGERPRINTS
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key) if isinstance(known, dict) else None
    if isinstance(entry, list) and len(entry) == 4 and entry[:3] == stamp:
        return entry[3]
    ident = _tokenizer_identity(tok.parent)
    if ident is None:
        return None
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    kept = {k: v for k, v in (known.items() if isinstance(known, dict) else ()) if k != key}
    kept = dict(list(kept.items())[-(MAX_FINGERPRINTS - 1):])  # the newest (tests make many)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**kept, key: [*stamp, digest]}))
    except OSError:
        pass  # a read-only home: computed every time
    return digest


def tokenizer_fingerprint(model_dir: Path) -> str | None:
    """Hash of the vocabulary, merges and added tokens; a draft that ships no tokenizer files
    records its target's fingerprint in config.json (``memspec_tokenizer_sha256``) instead."""
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        return _stamped_fingerprint(tok)
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = cfg.get("memspec_tokenizer_sha256")
    return value if isinstance(value, str) else None


def check_paths(pool: PoolConfig) -> None:
    """Every model dir exists, has a config, and every draft speaks the target's tokenizer."""
    if not (pool.target / "config.json").is_file():
        fix = ("run `memspec zoo target` to build it" if pool.target.name == TARGET_DIRNAME
               or pool.target == default_target_dir() else "point pool.target at an HF model dir")
        raise ConfigError(f"target model not found at {pool.target}", fix)
    target_tok = tokenizer_fingerprint(pool.target)
    for d in pool.drafts:
        if not (d.path / "config.json").is_file():
            build = "memspec zoo stores" if d.kind == "datastore" else "memspec zoo drafts"
            raise ConfigError(f"draft '{d.name}' not found at {d.path}",
                              f"fix drafts.path or run `{build}`")
        check_kind(d)
        draft_tok = tokenizer_fingerprint(d.path)
        if draft_tok is None:
            raise ConfigError(f"draft '{d.name}' has no tokenizer.json",
                              "copy the target's tokenizer files into the draft folder")
        if target_tok is not None and draft_tok != target_tok:
            raise ConfigError(f"draft '{d.name}' uses a different tokenizer than the target",
                              "drafts must share the target's tokenizer; retrain or remove it")


def folder_kind(model_dir: Path) -> str:
    """What a draft folder holds, from its config.json (heads and datastores say
    ``memspec_kind``)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "model"
    kind = cfg.get("memspec_kind") if isinstance(cfg, dict) else None
    return kind if kind in ("head", "datastore") else "model"


def check_kind(d: DraftSpec) -> None:
    actual = folder_kind(d.path)
    if actual != d.kind:
        raise ConfigError(f"draft '{d.name}' is kind = \"{d.kind}\" in the pool but {d.path} "
                          f"holds a {actual}", f"set kind = \"{actual}\" for it or fix its path")


# --- requests ------------------------------------------------------------------------------
def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} = {value!r} is not a finite number", f"give {name} a number")
    return float(value)


def check_sampling(temperature: object, top_p: object, seed: object, top_k: object = 0,
                   min_p: object = 0.0) -> None:
    """Every sampling parameter, finite and in range: the one check the CLI, the decoder
    (through SamplingParams) and `limits.check_request` share."""
    if _finite("temperature", temperature) < 0:
        raise RequestError(f"temperature {temperature} is negative", "use 0 (greedy) or more")
    if not 0 < _finite("top_p", top_p) <= 1:
        raise RequestError(f"top_p {top_p} is outside (0, 1]", "use e.g. 0.9")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise RequestError(f"seed {seed!r} is not an integer in [0, 2^64)",
                           "use a non-negative integer seed")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise RequestError(f"top_k {top_k!r} is not an integer >= 0",
                           "use 0 (off), 1 (greedy) or more")
    if not 0 <= _finite("min_p", min_p) <= 1:
        raise RequestError(f"min_p {min_p} is outside [0, 1]", "use 0 (off) or e.g. 0.05")
