"""Train the five demo drafts (general + code, math, law, medical) that the default pool ships.

Acceptance against the target's greedy output is what counts, so training is mostly
sequence-level distillation: the target's own greedy responses to the training prompts
(loss on the response only), mixed with domain corpus text for breadth. The general draft
is trained from scratch on all domains; each domain draft is fine-tuned from it on its own
domain, with a little general data mixed back in so it does not forget how to be a draft.

The 49,152-token target vocabulary would dominate a tiny draft, so drafts use a
frequency-ranked subset of target ids with an id map stored in the weight file
(``memspec.draft_to_target``); target ids outside the subset reach the draft as index 0.

Every step is idempotent and cached under ``memspec_home()/draft_work``; ``--force`` retrains.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from memspec.common.config import tokenizer_fingerprint
from memspec.common.machine import machine_line
from memspec.common.paths import PACKAGE_ROOT, default_target_dir, memspec_home
from memspec.procs.decoder.models import encode_prompt, load_causal_lm, load_tokenizer
from memspec.procs.decoder.slots import ID_MAP_KEY, SlotBuffer, load_into_slot
from memspec.zoo.corpora import DOMAINS, load_corpus
from memspec.zoo.prompts import load_prompts
from memspec.zoo.trajectories import build_trajectories

DRAFT_NAMES: tuple[str, ...] = ("general", "code", "math", "law", "medical")
DOMAIN_DRAFTS: tuple[str, ...] = DRAFT_NAMES[1:]
TARGET_VOCAB = 49152
SEED = 20260
GAMMA = 4
MAX_DRAFT_BYTES = 8_000_000
MAX_POOL_BYTES = 40_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
DOC_SEP = "\n\n"  # corpus documents are joined by a blank line (id 0 is reserved for 'rare')
DEV_PROMPTS_PER_DOMAIN = 20
DISTILL_WINDOWS = 96  # general: 96 x 256 target-labelled positions
DOMAIN_DISTILL_WINDOWS = 288  # domain drafts: acceptance grew with every extra label
IGNORE = -100


@dataclass(frozen=True)
class DraftArch:
    """Tiny Llama: tied embeddings over the draft vocabulary dominate the byte count."""

    vocab: int = 8192
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    max_positions: int = 2048

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
            max_position_embeddings=self.max_positions, rope_theta=100000.0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rms_norm_eps=1e-5, dtype="bfloat16")


@dataclass(frozen=True)
class TrainPlan:
    """One draft's recipe: where its batches come from and how long it may train."""

    name: str
    minutes: float
    lr: float
    corpus_domains: tuple[str, ...]
    traj_domains: tuple[str, ...]
    traj_weight: float  # share of batches drawn from target responses
    general_weight: float = 0.0  # share of batches drawn from the all-domain mix (fine-tunes)
    distill_weight: float = 0.0  # share of corpus windows labelled with the target's argmax
    distill_domains: tuple[str, ...] = ()
    distill_windows: int = DISTILL_WINDOWS  # target-labelled corpus windows per domain
    init_from: str | None = None
    batch: int = 16
    seq_len: int = 256
    max_traj_len: int = 512
    warmup_steps: int = 60
    seed: int = SEED


def default_plans(minutes: float | None) -> dict[str, TrainPlan]:
    """General from scratch (~8 min); domains distilled from it (~5 min each).

    As in the paper, the general draft is the not-yet-specialised base: it learns the text of
    every domain but is distilled toward the target only on general instructions. Each
    domain draft is then distilled on its own domain: the target's greedy responses and
    its argmax labels on domain text, which is where acceptance comes from.
    """
    plans = {"general": TrainPlan("general", minutes or 8.0, 3e-3, DOMAINS, ("general",), 0.25,
                                  distill_weight=0.25, distill_domains=("general",))}
    for d in DOMAIN_DRAFTS:  # 288 target-labelled windows beat 96 on every domain
        windows, mins = (576, 8.0) if d == "code" else (DOMAIN_DISTILL_WINDOWS, 6.0)
        plans[d] = TrainPlan(d, minutes or mins, 2e-3, (d,), (d,), 0.3, distill_weight=0.5,
                             distill_domains=(d,), distill_windows=windows,
                             init_from="general", warmup_steps=10)
    return plans


# --------------------------------------------------------------------------- paths, logging


def drafts_dir() -> Path:
    return PACKAGE_ROOT / "drafts" / "models"


def work_dir() -> Path:
    return memspec_home() / "draft_work"


def train_traces_path() -> Path:
    return memspec_home() / "traces" / "train.jsonl"


def dev_traces_path() -> Path:
    return memspec_home() / "traces" / "dev.jsonl"  # the file `memspec trace` fills for dev


def log(step: str, msg: str) -> None:
    print(f"[drafts:{step}] {msg}", file=sys.stderr, flush=True)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- step a: traces


def _complete_rows(path: Path) -> dict[str, dict]:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line another process is still writing
                continue
            rows[row["id"]] = row
    return rows


def ensure_trajectories(prompts: list[dict], out: Path, target_dir: Path,
                        also: Sequence[Path] = (), generate: bool = True) -> list[dict]:
    """Target greedy responses; the builder is resumable, so only missing ids cost time.

    ``also``: files written by other commands (read only) whose rows are reused, since with
    greedy decoding a prompt's trajectory is the same whoever computed it.
    """
    have: dict[str, dict] = {}
    for path in (*also, out):
        have.update(_complete_rows(path))
    missing = [p for p in prompts if p["id"] not in have]
    if missing and generate:
        model, tok = load_causal_lm(target_dir, device=device()), load_tokenizer(target_dir)
        for row in build_trajectories(model, tok, target_dir, missing, out):
            have[row["id"]] = row
    return [have[p["id"]] for p in prompts if p["id"] in have]


def dev_prompts(per_domain: int = DEV_PROMPTS_PER_DOMAIN) -> list[dict]:
    """The first dev prompts of each domain: drafts are chosen on dev, never on a set that
    measures them (dev2, test2)."""
    return load_prompts("dev", DOMAINS, per_domain)


# --------------------------------------------------------------------------- tokenised corpora


def corpus_tokens(domain: str, tokenizer, force: bool = False) -> np.ndarray:
    """All train documents of a domain as one uint16 target-id stream (cached)."""
    cache = work_dir() / "tokens" / f"{domain}.npy"
    if cache.is_file() and not force:
        return np.load(cache)
    t0 = time.perf_counter()
    texts = [d["text"] for d in load_corpus(memspec_home() / "corpora", domain, "train")]
    sep = tokenizer(DOC_SEP, add_special_tokens=False)["input_ids"]
    parts: list[int] = []
    for start in range(0, len(texts), 256):
        for ids in tokenizer(texts[start:start + 256], add_special_tokens=False)["input_ids"]:
            parts.extend(ids)
            parts.extend(sep)
    arr = np.asarray(parts, dtype=np.uint16)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    log("tokens", f"{domain}: {arr.size:,} tokens from {len(texts)} docs "
        f"in {time.perf_counter() - t0:.1f}s")
    return arr


def cached_labels(domain: str, windows: int, seq_len: int = 256
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """target_labels' windows and labels when its cache already holds ``windows`` of them."""
    cache = work_dir() / "distill" / f"{domain}_{seq_len}.npz"
    if cache.is_file():
        got = np.load(cache)
        if len(got["x"]) >= windows:
            return got["x"][:windows], got["y"][:windows]
    return None


@torch.inference_mode()
def target_labels(domain: str, corpus: np.ndarray, target, windows: int, seq_len: int = 256,
                  batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The target's argmax after every prefix of random corpus windows (cached, resumable).

    One batched teacher-forced pass labels ``seq_len`` positions at once: far cheaper than
    generating, and it is exactly what greedy acceptance rewards.
    """
    got = cached_labels(domain, windows, seq_len)
    if got is not None:
        return got
    cache = work_dir() / "distill" / f"{domain}_{seq_len}.npz"
    rng = np.random.default_rng(SEED + DOMAINS.index(domain))
    starts = rng.integers(0, corpus.size - seq_len - 1, windows)
    x = np.stack([corpus[s:s + seq_len] for s in starts]).astype(np.int64)
    y = np.zeros_like(x)
    t0 = time.perf_counter()
    for i in range(0, windows, batch):
        ids = torch.from_numpy(x[i:i + batch]).to(device())
        y[i:i + batch] = target(ids).logits.argmax(-1).cpu().numpy()
        if (i // batch) % 10 == 0:
            rate = (i + batch) * seq_len / (time.perf_counter() - t0)
            log("distill", f"{domain}: {min(i + batch, windows)}/{windows} windows, "
                f"{rate:.0f} tokens/s")
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, x=x.astype(np.uint16), y=y.astype(np.uint16))
    return x.astype(np.uint16), y.astype(np.uint16)


# --------------------------------------------------------------------------- step b: vocabulary


def chat_tokens(tokenizer) -> list[int]:
    """Tokens of the chat template itself: always in the draft vocabulary."""
    ids = set(encode_prompt(tokenizer, "x"))
    ids.update(tokenizer.all_special_ids)
    return sorted(ids)


def rank_vocabulary(corpora: dict[str, np.ndarray], trajs: list[dict], forced: Sequence[int],
                    size: int, response_weight: float = 4.0) -> np.ndarray:
    """Frequency-ranked target ids: each domain's corpus counts equally, responses count more.

    Index 0 is target id 0 (``<|endoftext|>``), which the target never emits mid-response:
    it doubles as the 'rare token' input, so an out-of-vocabulary id reads as one thing.
    """
    score = np.zeros(TARGET_VOCAB, dtype=np.float64)
    for arr in corpora.values():
        score += np.bincount(arr, minlength=TARGET_VOCAB) / max(arr.size, 1)
    resp = np.asarray([t for r in trajs for t in r["tokens"]], dtype=np.int64)
    prompt = np.asarray([t for r in trajs for t in r["prompt_ids"]], dtype=np.int64)
    score += response_weight * np.bincount(resp, minlength=TARGET_VOCAB) / max(resp.size, 1)
    score += np.bincount(prompt, minlength=TARGET_VOCAB) / max(prompt.size, 1)
    score[list(forced)] = np.inf
    score[0] = -np.inf
    order = [int(i) for i in np.argsort(-score, kind="stable") if score[i] > 0]
    return np.asarray([0] + order[: size - 1], dtype=np.int64)


def inverse_map(to_target: np.ndarray) -> np.ndarray:
    """Target id -> draft index, unknown ids -> 0 (exactly what the slot binder builds)."""
    inv = np.zeros(TARGET_VOCAB, dtype=np.int64)
    inv[to_target] = np.arange(to_target.size)
    return inv


def coverage(to_target: np.ndarray, ids: np.ndarray) -> float:
    keep = np.zeros(TARGET_VOCAB, dtype=bool)
    keep[to_target] = True
    return float(keep[ids].mean()) if ids.size else 1.0


def ensure_vocabulary(corpora: dict[str, np.ndarray], trajs: list[dict], tokenizer,
                      size: int, force: bool = False) -> np.ndarray:
    path = work_dir() / f"vocab_{size}.npy"
    if path.is_file() and not force:
        return np.load(path)
    vocab = rank_vocabulary(corpora, trajs, chat_tokens(tokenizer), size)
    np.save(path, vocab)
    resp = np.asarray([t for r in trajs for t in r["tokens"]], dtype=np.int64)
    cov = {d: round(coverage(vocab, a.astype(np.int64)), 4) for d, a in corpora.items()}
    log("vocab", f"{size} ids; coverage responses {coverage(vocab, resp):.4f}, corpora {cov}")
    return vocab


# --------------------------------------------------------------------------- batches


@dataclass
class Batches:
    """Samplers in draft-index space: corpus windows and (prompt, response) examples."""

    inv: np.ndarray
    corpora: dict[str, np.ndarray]
    trajs: dict[str, list[dict]]
    rng: np.random.Generator
    seq_len: int
    max_traj_len: int
    distill: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def _labels(self, target_ids: np.ndarray) -> np.ndarray:
        lab = self.inv[target_ids]
        lab[(lab == 0) & (target_ids != 0)] = IGNORE  # a rare token cannot be proposed
        return lab

    def corpus(self, domains: Sequence[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(n):
            arr = self.corpora[domains[self.rng.integers(len(domains))]]
            s = int(self.rng.integers(0, arr.size - self.seq_len - 1))
            rows.append(arr[s:s + self.seq_len + 1].astype(np.int64))
        win = np.stack(rows)
        return torch.from_numpy(self.inv[win[:, :-1]]), torch.from_numpy(self._labels(win[:, 1:]))

    def responses(self, domains: Sequence[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt_ids + tokens, right-padded; loss on response tokens only."""
        pool = [r for d in domains for r in self.trajs[d]]
        if not pool:  # no target responses for these domains (yet): corpus text instead
            return self.corpus(domains, n)
        picks = [pool[int(i)] for i in self.rng.integers(0, len(pool), n)]
        seqs, starts = [], []
        for r in picks:
            ids = (r["prompt_ids"] + r["tokens"])[-self.max_traj_len:]
            seqs.append(np.asarray(ids, dtype=np.int64))
            starts.append(max(len(ids) - len(r["tokens"]), 1))
        width = max(s.size for s in seqs) - 1
        x = np.zeros((n, width), dtype=np.int64)
        y = np.full((n, width), IGNORE, dtype=np.int64)
        for i, (s, st) in enumerate(zip(seqs, starts)):
            x[i, :s.size - 1] = self.inv[s[:-1]]
            y[i, st - 1:s.size - 1] = self._labels(s[st:])
        return torch.from_numpy(x), torch.from_numpy(y)

    def distilled(self, domains: Sequence[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Corpus windows whose labels are the target's own argmax (its greedy choice)."""
        doms = [d for d in domains if d in self.distill]
        if not doms:
            return self.corpus(domains, n)
        xs, ys = [], []
        for _ in range(n):
            win, lab = self.distill[doms[self.rng.integers(len(doms))]]
            i = int(self.rng.integers(len(win)))
            xs.append(win[i].astype(np.int64))
            ys.append(lab[i].astype(np.int64))
        x, y = np.stack(xs), np.stack(ys)
        return torch.from_numpy(self.inv[x]), torch.from_numpy(self._labels(y))

    def draw(self, plan: TrainPlan) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.rng.random()
        if u < plan.distill_weight:
            return self.distilled(plan.distill_domains, plan.batch)
        u -= plan.distill_weight
        if u < plan.general_weight:
            if self.rng.random() < 0.5:
                return self.responses(DOMAINS, plan.batch)
            return self.corpus(DOMAINS, plan.batch)
        if u < plan.general_weight + plan.traj_weight:
            return self.responses(plan.traj_domains, plan.batch)
        return self.corpus(plan.corpus_domains, plan.batch)


# --------------------------------------------------------------------------- steps c, d: training


@dataclass
class TrainRecord:
    name: str
    steps: int = 0
    tokens_seen: int = 0
    loss_tokens_seen: int = 0
    wall_s: float = 0.0
    final_loss: float = float("nan")
    plan: dict = field(default_factory=dict)
    arch: dict = field(default_factory=dict)
    machine: str = ""


def lr_at(plan: TrainPlan, step: int, frac: float) -> float:
    """Linear warm-up, then cosine to 10% over the wall-clock budget."""
    warm = min(1.0, (step + 1) / plan.warmup_steps)
    return plan.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def new_model(arch: DraftArch, seed: int, embed: torch.Tensor | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = arch.config()
    cfg.dtype = torch.float32
    model = LlamaForCausalLM(cfg)
    if embed is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embed)
    return model


def target_embedding_init(target_dir: Path, vocab: np.ndarray, width: int,
                          std: float = 0.02) -> torch.Tensor:
    """The target's (tied) embeddings of the draft vocabulary, PCA-projected to the draft width.

    A warm start worth many CPU minutes: token geometry (and, through the tied head, which
    tokens are interchangeable) is known from step 0 instead of learned from ~1M tokens.
    """
    from memspec.procs.decoder.forward.checkpoint import load_state_dict

    weights = load_state_dict(target_dir)  # a GGUF-block folder's blocks dequantised
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    emb = weights[key].float()[torch.from_numpy(vocab)]
    emb = emb - emb.mean(0, keepdim=True)
    u, sv, _ = torch.linalg.svd(emb, full_matrices=False)
    proj = u[:, :width] * sv[:width]
    return proj * (std / proj.std())


def masked_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on labelled positions only: the vocabulary projection is most of the
    compute, and prompt tokens of a response example carry no loss."""
    hidden = model.model(x).last_hidden_state
    keep = y != IGNORE
    return F.cross_entropy(model.lm_head(hidden[keep]).float(), y[keep])


def train(model: LlamaForCausalLM, batches: Batches, plan: TrainPlan,
          on_log: Callable[[str], None] | None = None) -> TrainRecord:
    """AdamW on a wall-clock budget; the budget, not a step count, is what the issue caps."""
    dev = device()
    model.to(dev).train()
    torch.manual_seed(plan.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.1)
    busy = f", 1-min load average {os.getloadavg()[0]:.1f} at start"  # shared machines
    rec = TrainRecord(plan.name, plan=asdict(plan), machine=machine_line() + busy)
    budget, t0, ema = plan.minutes * 60.0, time.perf_counter(), None
    while (elapsed := time.perf_counter() - t0) < budget:
        x, y = batches.draw(plan)
        for g in opt.param_groups:
            g["lr"] = lr_at(plan, rec.steps, elapsed / budget)
        loss = masked_loss(model, x.to(dev), y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec.steps += 1
        rec.tokens_seen += x.numel()
        rec.loss_tokens_seen += int((y != IGNORE).sum())
        val = float(loss.detach())
        ema = val if ema is None else 0.98 * ema + 0.02 * val
        if rec.steps % 50 == 0 and on_log:
            on_log(f"step {rec.steps} {elapsed:.0f}s loss {ema:.3f} "
                   f"{rec.tokens_seen / max(elapsed, 1e-9):.0f} tok/s")
    rec.wall_s = time.perf_counter() - t0
    rec.final_loss = float(ema) if ema is not None else float("nan")
    model.eval()
    return rec


# --------------------------------------------------------------------------- saving


def save_draft(model: LlamaForCausalLM, to_target: np.ndarray, out: Path,
               target_dir: Path) -> int:
    """One bf16 model.safetensors (tied head omitted) + id map; config.json records the
    target's tokenizer fingerprint instead of a 3.5 MB copy of its tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state[ID_MAP_KEY] = torch.from_numpy(np.ascontiguousarray(to_target, dtype=np.int64))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(model.config)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], torch.bfloat16  # file dtype = compute
    cfg.memspec_tokenizer_sha256 = tokenizer_fingerprint(target_dir)
    cfg.save_pretrained(out)
    for name in TOKENIZER_FILES:  # drop copies an older build left behind
        (out / name).unlink(missing_ok=True)
    return (out / "model.safetensors").stat().st_size


def load_draft_fp32(path: Path) -> tuple[LlamaForCausalLM, np.ndarray]:
    """Reload a saved draft and its id map for fine-tuning (fp32 weights from the bf16 file)."""
    bound = load_into_slot(path.name, path, SlotBuffer(MAX_DRAFT_BYTES * 2),
                           target_vocab=TARGET_VOCAB)
    model = LlamaForCausalLM(bound.model.config)
    sd = {k: v.float() for k, v in bound.model.state_dict().items()}
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model, bound.to_target.cpu().numpy().copy()


# --------------------------------------------------------------------------- acceptance (dev)


@torch.inference_mode()
def measure_acceptance(names: Sequence[str], rows: list[dict]) -> dict:
    """Teacher-forced tables for the saved (bf16, slot-bound) drafts: what ships is measured.

    The same table and replay code as `memspec zoo eval` (zoo/tables.py, zoo/evaluate.py).
    """
    from memspec.zoo.evaluate import acceptance_report, draft_tables

    rows = [r for r in rows if r["tokens"]]
    tables = {}
    for name in names:
        bound = load_into_slot(name, drafts_dir() / name, SlotBuffer(MAX_DRAFT_BYTES * 2),
                               target_vocab=TARGET_VOCAB)
        tables[name] = draft_tables(bound, rows, GAMMA, TARGET_VOCAB)
    domains = [d for d in DOMAINS if any(r["domain"] == d for r in rows)]
    rep = acceptance_report(tables, rows, "general" if "general" in tables else names[0],
                            domains, GAMMA, 4)
    rep["prompts"] = {d: sum(r["domain"] == d for r in rows) for d in domains}
    rep["oracle_static"] = rep["oracle_static_mean_acceptance_length"]
    rep["oracle_dynamic"] = rep["oracle_dynamic_mean_acceptance_length"]
    return rep


def format_report(rep: dict) -> str:
    tab = rep["mean_acceptance_length"]
    doms = list(next(iter(tab.values())))
    lines = ["draft      " + " ".join(f"{d:>8}" for d in doms)]
    lines += [f"{n:<10} " + " ".join(f"{tab[n][d]:8.3f}" for d in doms) for n in tab]
    for key in ("oracle_static", "oracle_dynamic"):
        lines.append(f"{key:<15}" + " ".join(f"{rep[key][d]:8.3f}" for d in doms))
    for key in ("oracle_static_over_general", "oracle_dynamic_over_oracle_static"):
        lines.append(f"{key}: " + ", ".join(f"{k} {v:.3f}" for k, v in rep[key].items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- model card


def write_card(name: str, rec: dict, data: dict, size: int, vocab: int, arch: DraftArch,
               report: dict | None) -> None:
    """README.md with what a reader needs to trust (or redo) the draft."""
    acc = ""
    if report:
        row = report["mean_acceptance_length"].get(name, {})
        gen = report["mean_acceptance_length"].get("general", {})
        acc = "\n".join(f"| {d} | {row[d]:.3f} | {gen.get(d, float('nan')):.3f} |" for d in row)
        acc = ("\n## Measured acceptance (dev split, teacher-forced replay, greedy, gamma=4)\n\n"
               f"Dev prompts per domain (first of each domain): {report.get('prompts')}; "
               "target greedy "
               "trajectories of at most 128 new tokens. Mean acceptance length "
               "(1 + accepted / iterations):\n\n| domain | this draft | general draft |\n"
               "|---|---|---|\n" + acc + "\n")
    plan = rec["plan"]
    src = ("from scratch; token embeddings initialised from a PCA of the target's embeddings "
           "of the draft vocabulary" if not plan.get("init_from")
           else f"fine-tuned from `{plan['init_from']}`")
    if rec.get("continued_from"):  # a second round on the same recipe (steps/time are totals)
        first = rec["continued_from"]
        src = (f"fine-tuned from `{first['plan']['init_from']}` for {first['steps']} steps / "
               f"{first['wall_s']:.0f} s at lr {first['plan']['lr']}, then continued on the "
               f"same data at lr {plan['lr']}")
    text = f"""# memspec draft `{name}`

Draft model for speculative decoding with SmolLM2-135M-Instruct (target), trained by
`memspec zoo drafts` ({src}). Shares the target's tokenizer; uses a frequency-ranked
{vocab}-token subset of the target vocabulary, mapped by the int64 tensor
`{ID_MAP_KEY}` in `model.safetensors` (out-of-subset target ids are fed as index 0).

## Architecture
Llama, {arch.layers} layers, hidden {arch.hidden}, {arch.heads} heads / {arch.kv_heads} KV heads
(GQA, head dim {arch.hidden // arch.heads}), MLP {arch.intermediate}, tied embeddings,
vocab {vocab}, bfloat16 weights. File size: {size:,} bytes ({size / 1e6:.2f} MB).

## Data
- corpus text ({', '.join(plan['corpus_domains'])}): {data['corpus_tokens']:,} train tokens
  available (`models/corpora/<domain>/train.jsonl`, target tokenizer)
- target greedy responses (distillation) to `prompts/train.jsonl`
  ({', '.join(plan['traj_domains'])}): {data['traj_prompts']} prompts,
  {data['response_tokens']:,} response tokens; loss on response tokens only
- target argmax labels on corpus windows ({', '.join(plan.get('distill_domains', ()))}):
  {data.get('target_labelled_tokens', 0):,} labelled positions (teacher-forced target pass)
- batch shares: target labels {plan.get('distill_weight', 0):.2f}, responses
  {plan['traj_weight']:.2f}, all-domain mix {plan['general_weight']:.2f}, rest corpus text
  ({', '.join(plan['corpus_domains'])}); batch {plan['batch']}, corpus windows
  {plan['seq_len']} tokens
- tokens processed: {rec['tokens_seen']:,} ({rec['loss_tokens_seen']:,} with loss)

## Training
- seed: {plan['seed']}
- steps: {rec['steps']}
- wall time: {rec['wall_s']:.0f} s (budget {plan['minutes']:.1f} min)
- optimiser: AdamW lr {plan['lr']}, betas (0.9, 0.95), wd 0.1, warm-up
  {plan['warmup_steps']} steps, cosine to 10% over the wall-clock budget
- final loss (EMA): {rec['final_loss']:.3f}
- machine: {rec['machine']}
{acc}"""
    (drafts_dir() / name / "README.md").write_text(text)


# --------------------------------------------------------------------------- orchestration


def data_summary(plan: TrainPlan, corpora: dict[str, np.ndarray],
                 trajs: dict[str, list[dict]],
                 distill: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> dict:
    rows = [r for d in plan.traj_domains for r in trajs[d]]
    return {"corpus_tokens": int(sum(corpora[d].size for d in plan.corpus_domains)),
            "traj_prompts": len(rows),
            "response_tokens": int(sum(len(r["tokens"]) for r in rows)),
            "target_labelled_tokens": int(sum((distill or {})[d][1].size
                                              for d in plan.distill_domains
                                              if d in (distill or {})))}


def train_one(plan: TrainPlan, arch: DraftArch, batches: Batches, vocab: np.ndarray,
              target_dir: Path) -> dict:
    """Train (or fine-tune) one draft, save it, and keep its record for the model card.

    A fine-tune keeps its parent's vocabulary whatever ``vocab`` says: the embedding rows
    are the parent's, so its id map must be too.
    """
    if plan.init_from:
        model, vocab = load_draft_fp32(drafts_dir() / plan.init_from)
        batches.inv = inverse_map(vocab)
    else:
        batches.inv = inverse_map(vocab)
        model = new_model(arch, plan.seed, target_embedding_init(target_dir, vocab, arch.hidden))
    rec = train(model, batches, plan, on_log=lambda m: log(plan.name, m))
    size = save_draft(model, vocab, drafts_dir() / plan.name, target_dir)
    out = asdict(rec) | {"size_bytes": size, "arch": asdict(arch),
                         "data": data_summary(plan, batches.corpora, batches.trajs,
                                              batches.distill)}
    (work_dir() / "records").mkdir(parents=True, exist_ok=True)
    (work_dir() / "records" / f"{plan.name}.json").write_text(json.dumps(out, indent=2))
    log(plan.name, f"saved {size:,} bytes, {rec.steps} steps, {rec.wall_s:.0f}s, "
        f"loss {rec.final_loss:.3f}")
    if size > MAX_DRAFT_BYTES:
        raise RuntimeError(f"draft {plan.name} is {size:,} bytes > {MAX_DRAFT_BYTES:,}")
    return out


def train_prompts(per_domain: int | None = None) -> list[dict]:
    """``prompts/train.jsonl``, optionally only the first ``per_domain`` of each domain."""
    return load_prompts("train", None if per_domain is None else DOMAINS, per_domain)


def build_drafts(names: Sequence[str] | None = None, minutes: float | None = None,
                 force: bool = False, arch: DraftArch | None = None,
                 target_dir: Path | None = None, train_per_domain: int | None = None,
                 new_traces: bool = True) -> dict:
    """Steps a-e; returns the dev acceptance report. Drafts already on disk are kept.

    ``train_per_domain`` limits distillation to the first prompts of each domain (a CPU
    session that cannot afford all 500 target trajectories); ``new_traces=False`` trains on
    the train trajectories already on disk and generates none (dev ones are always
    completed: the acceptance check needs them).
    """
    if not torch.cuda.is_available():
        torch.set_num_threads(min(torch.get_num_threads(), 2))  # the 2-core budget
    arch, target_dir = arch or DraftArch(), target_dir or default_target_dir()
    names = list(DRAFT_NAMES if names is None else names)
    t0 = time.perf_counter()
    tok = load_tokenizer(target_dir)
    log("a", "train trajectories")
    train_rows = ensure_trajectories(train_prompts(train_per_domain), train_traces_path(),
                                     target_dir, generate=new_traces)
    trajs = {d: [r for r in train_rows if r["domain"] == d and r["tokens"]] for d in DOMAINS}
    corpora = {d: corpus_tokens(d, tok, force=False) for d in DOMAINS}
    log("b", f"vocabulary ({time.perf_counter() - t0:.0f}s)")
    # a new vocabulary only when the general draft (the root of the family) is retrained
    vocab = ensure_vocabulary(corpora, train_rows, tok, arch.vocab, force and "general" in names)
    plans = default_plans(minutes)
    windows: dict[str, int] = {}
    for n in names:
        for d in plans[n].distill_domains:
            windows[d] = max(windows.get(d, 0), plans[n].distill_windows)
    distill = {}
    if windows:
        log("a", f"target labels on corpus windows for {sorted(windows)}")
        target = load_causal_lm(target_dir, device=device())
        distill = {d: target_labels(d, corpora[d], target, w) for d, w in sorted(windows.items())}
        del target
    batches = Batches(inverse_map(vocab), corpora, trajs, np.random.default_rng(SEED), 256, 512,
                      distill)
    for name in DRAFT_NAMES:
        if name not in names:
            continue
        if (drafts_dir() / name / "model.safetensors").is_file() and not force:
            log(name, "present, skipped (use --force to retrain)")
            continue
        batches.rng = np.random.default_rng(plans[name].seed + DRAFT_NAMES.index(name))
        batches.seq_len, batches.max_traj_len = plans[name].seq_len, plans[name].max_traj_len
        log("c" if name == "general" else "d", f"training {name} "
            f"({time.perf_counter() - t0:.0f}s elapsed)")
        train_one(plans[name], arch, batches, vocab, target_dir)
    log("e", "dev acceptance")
    dev = ensure_trajectories(dev_prompts(), dev_traces_path(), target_dir)
    present = [n for n in DRAFT_NAMES if (drafts_dir() / n / "model.safetensors").is_file()]
    report = measure_acceptance(present, dev)
    (work_dir() / "acceptance.json").write_text(json.dumps(report, indent=2))
    print(format_report(report), file=sys.stderr)
    for name in present:
        rec_path = work_dir() / "records" / f"{name}.json"
        if rec_path.is_file():
            rec = json.loads(rec_path.read_text())
            data = rec.get("data") or data_summary(plans[name], corpora, trajs)
            write_card(name, rec, data, rec["size_bytes"], int(vocab.size), arch, report)
    total = sum((drafts_dir() / n / "model.safetensors").stat().st_size for n in present)
    log("e", f"pool {total:,} bytes; done in {time.perf_counter() - t0:.0f}s")
    return report


def main_models(args) -> int:
    """``memspec zoo drafts --pool pools/small-models.toml [--only a,b] [--minutes M]
    [--force]``: the small independent draft models (a pool of heads: zoo/heads.py)."""
    only = [s.strip() for s in args.only.split(",")] if getattr(args, "only", None) else None
    unknown = [n for n in only or [] if n not in DRAFT_NAMES]
    if unknown:
        print(f"error: unknown draft(s) {unknown}; choose from {list(DRAFT_NAMES)}",
              file=sys.stderr)
        return 2
    report = build_drafts(only, getattr(args, "minutes", None), getattr(args, "force", False))
    print(json.dumps(report))
    return 0
