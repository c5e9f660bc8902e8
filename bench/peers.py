"""What a user would run instead of memspec, on the same machine, GGUF and prompts: llama.cpp.

Three peers, each at its fastest setting on this machine (every core):
- `llama.cpp`: plain greedy decoding through llama.cpp's C API (one `llama_decode` of the
  prompt, then one per token and the argmax of its logits): llama.cpp itself, with no
  Python sampling in its way;
- `llama.cpp-py`: llama-cpp-python's `create_completion` (greedy), what most Python users
  call;
- `llama.cpp-py+lookup`: the same with its own prompt-lookup speculation
  (`LlamaPromptLookupDecoding`, gamma tokens a proposal).

`memspec bench` runs them beside memspec and target-only through the three processes,
interleaved per prompt, every clock from the call to the last token (prefill included),
with an unmeasured pause before each run (`SETTLE_S`). An EOS is never counted (llama.cpp
does not count it).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memspec.common.errors import ConfigError, MemspecError

PLAIN, PY, PY_LOOKUP = "llama.cpp", "llama.cpp-py", "llama.cpp-py+lookup"
PEERS = (PLAIN, PY, PY_LOOKUP)
OURS = ("memspec", "target-only")
N_CTX = 4096  # prompt + new tokens a peer run may hold (one llama_decode may fill it)
# runs before the measured ones, on a prompt of no prompt set: first calls pay one-off
# costs, and a measured prompt must not find its embedding already cached
WARM_PROMPT = "Write a Python function that returns the factorial of n."
# the bounds read these: memspec over llama.cpp plain (its fastest, the C API) and
# over its prompt-lookup speculation
RATIOS: dict[str, tuple[str, str]] = {
    "memspec_over_llama_cpp": ("memspec", PLAIN),
    "memspec_over_llama_cpp_lookup": ("memspec", PY_LOOKUP),
    "memspec_over_llama_cpp_py": ("memspec", PY),
    "target_only_over_llama_cpp": ("target-only", PLAIN),
    "llama_cpp_lookup_over_llama_cpp": (PY_LOOKUP, PLAIN),
    "llama_cpp_py_over_llama_cpp": (PY, PLAIN),
}


def _log(msg: str) -> None:
    print(f"[bench peers] {msg}", file=sys.stderr, flush=True)


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def source_gguf(target: Path) -> Path | None:
    """The GGUF a target folder was converted from (its `memspec zoo target` marker names
    it), where that file is still there: llama.cpp's side of a same-weights comparison."""
    try:
        src = json.loads((Path(target) / "memspec_convert.json").read_text())["source"]
        path = Path(src["file"]) if "/" in src["file"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if path is None:  # a marker of the first format named the wheel's file only
        from memspec.zoo.target import find_gguf

        try:
            return find_gguf()
        except MemspecError:
            return None
    return path if path.is_file() else None


def unavailable(target: Path) -> str | None:
    """Why llama.cpp cannot run beside this target (None: it can): it runs the GGUF the
    target folder was converted from, so only such a target has a peer on the same weights."""
    if not available():
        return "llama-cpp-python is not installed (pip install 'memspec[bench]')"
    if source_gguf(target) is None:
        return f"{target} was not converted from a GGUF that is still there"
    return None


def threads() -> int:
    """Every core this process may use: llama.cpp's fastest setting on a small CPU."""
    from memspec.procs.decoder.forward.threads import usable_cores

    return usable_cores()


class LlamaCpp:
    """The target's GGUF in llama.cpp, plain and with prompt lookup; each call starts from
    an empty cache."""

    def __init__(self, n_threads: int, gamma: int, gguf: Path | None = None) -> None:
        try:
            import llama_cpp as lc
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ConfigError("llama-cpp-python is not installed",
                              "pip install 'memspec[bench]'") from None
        from memspec.zoo.target import find_gguf

        self.lc, self.threads, self.gamma = lc, n_threads, gamma
        self.gguf = Path(gguf) if gguf is not None else find_gguf()
        kw = dict(model_path=str(self.gguf), n_threads=n_threads, n_threads_batch=n_threads,
                  n_ctx=N_CTX, n_batch=N_CTX, verbose=False, seed=0)
        self.plain = lc.Llama(**kw)
        self.lookup = lc.Llama(**kw, draft_model=LlamaPromptLookupDecoding(
            num_pred_tokens=gamma))
        self._ctx = self.plain._ctx.ctx
        self.vocab = lc.llama_model_get_vocab(self.plain._model.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def key(self) -> str:
        """What its figures depend on: the library, the file and the settings."""
        st = self.gguf.stat()
        return hashlib.sha256(json.dumps(
            [self.lc.__version__, self.gguf.name, st.st_size, self.threads, self.gamma,
             os.environ.get("LLAMA_CPP_LIB_PATH", "bundled")]).encode()).hexdigest()[:16]

    def system_info(self) -> str:
        info = self.lc.llama_print_system_info()
        return info.decode() if isinstance(info, bytes) else str(info)

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self._ctx), True)

    def fits(self, n: int) -> None:
        if n > N_CTX:
            raise ConfigError(f"a llama.cpp peer run of {n} tokens exceeds its context of "
                              f"{N_CTX}", "use shorter prompts or fewer new tokens")

    def decode(self, tokens: Sequence[int]) -> None:
        self.fits(len(tokens))
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        if self.lc.llama_decode(self._ctx, self.lc.llama_batch_get_one(arr, len(tokens))) != 0:
            raise MemspecError("llama.cpp's llama_decode failed", "see its log (verbose=True)")

    def rows(self, tokens: Sequence[int], pos: int) -> Any:
        """A batch of `tokens` at positions pos.., every row's logits asked for (a verify's
        work: the LM head for each row, as ours computes); free it with `free`."""
        self.fits(pos + len(tokens))
        batch = self.lc.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        return batch

    def free(self, batch: Any) -> None:
        self.lc.llama_batch_free(batch)

    def rows_at(self, batch: Any, pos: int) -> None:
        """Decode a `rows` batch made for `pos`, then drop its rows from the cache, so the
        same call can be timed again at the same context."""
        lc = self.lc
        if lc.llama_decode(self._ctx, batch) != 0:
            raise MemspecError("llama.cpp's llama_decode failed", "see its log (verbose=True)")
        lc.llama_memory_seq_rm(lc.llama_get_memory(self._ctx), 0, pos, -1)

    def perf_reset(self) -> None:
        self.lc.llama_perf_context_reset(self._ctx)

    def perf(self) -> dict[str, float]:
        """llama.cpp's own clocks since `perf_reset` (``llama_perf_context``, what its
        ``llama_perf_context_print`` reports): prompt evaluation and per-token decoding,
        ms and tokens. Beside the call-to-last-token clock they show where a gap lies."""
        self.lc.llama_synchronize(self._ctx)  # it adds a call's time only once synchronised
        d = self.lc.llama_perf_context(self._ctx)
        return {"prefill_ms": float(d.t_p_eval_ms), "prefill_tokens": int(d.n_p_eval),
                "decode_ms": float(d.t_eval_ms), "decode_tokens": int(d.n_eval)}

    def argmax(self) -> int:
        import numpy as np

        ptr = self.lc.llama_get_logits_ith(self._ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def greedy(self, ids: Sequence[int], max_new: int, eos: set[int],
               times: list[float] | None = None) -> list[int]:
        """Plain greedy decoding through the C API until `eos` or any token llama.cpp
        ends a generation at (as its `create_completion` stops); the tokens, that one
        left out. `times` gets each token's time since the call."""
        t0 = time.perf_counter()
        self.fits(len(ids) + max_new)
        self.reset()
        self.perf_reset()
        self.decode(list(ids))
        out: list[int] = []
        while len(out) < max_new:
            tok = self.argmax()
            if tok in eos or self.lc.llama_vocab_is_eog(self.vocab, tok):
                break
            out.append(tok)
            if times is not None:
                times.append(time.perf_counter() - t0)
            if len(out) < max_new:
                self.decode([tok])
        return out

    def completion(self, ids: Sequence[int], max_new: int, lookup: bool) -> int:
        """llama-cpp-python's greedy completion; how many tokens it made."""
        self.fits(len(ids) + max_new)
        llm = self.lookup if lookup else self.plain
        llm.reset()
        out = llm.create_completion(prompt=list(ids), max_tokens=max_new, temperature=0.0,
                                    top_k=1)
        return int(out["usage"]["completion_tokens"])


Run = dict[str, Any]  # {"tokens": n, "seconds": s, "ids": [...] or None, ...}
# between two runs, unmeasured: llama.cpp's OpenMP workers spin on after its last call (a
# prefill right after one ran up to 2x slower), and no run may inherit another's tail
SETTLE_S = 0.5
VERSION = 3  # of the rows' meaning: a cache of another version is measured again


def timed(fn: Callable[[], tuple[int, list[int] | None]]) -> Run:
    t0 = time.perf_counter()
    n, ids = fn()
    return {"tokens": n, "seconds": time.perf_counter() - t0, "ids": ids}


def order(i: int, names: Sequence[str]) -> list[str]:
    """Every prompt's runs rotated by its index, the cycle reversed on every other round of
    rotations: each entry runs first as often as any, and after either neighbour."""
    k = i % len(names)
    cyc = list(names) if (i // len(names)) % 2 == 0 else list(reversed(names))
    return [*cyc[k:], *cyc[:k]]


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """GMEAN over prompts of each ratio with its 95% interval (prompts resampled within
    domains), tokens/s per entry, and how often llama.cpp's greedy tokens are ours."""
    from memspec.bench.stats import headline_ratios

    names = (*OURS, *PEERS)
    runs = {n: {r["id"]: [(r[n]["tokens"], r[n]["seconds"])] for r in rows} for n in names}
    gm, ci = headline_ratios(runs, {r["id"]: r["domain"] for r in rows}, RATIOS)
    same = [r["memspec"]["ids"] == r[PLAIN]["ids"] for r in rows]
    tok_s = {n: [r[n]["tokens"] / r[n]["seconds"] for r in rows if r[n]["seconds"] > 0]
             for n in names}
    perf = [r[PLAIN]["llama_perf"] for r in rows if r[PLAIN].get("llama_perf")]
    own = {k: sum(p[k] for p in perf) for k in perf[0]} if perf else {}
    return {"prompts": len(rows), "gmean": gm, "ci95": ci,
            # llama.cpp's own report of its plain runs (llama_perf_context), beside the
            # call-to-last-token clock above: prompt evaluation and decoding, per token
            "llama_cpp_own_clock": {
                "prefill_ms_per_prompt": own["prefill_ms"] / len(perf),
                "prefill_tok_s": 1e3 * own["prefill_tokens"] / own["prefill_ms"],
                "decode_tok_s": 1e3 * own["decode_tokens"] / own["decode_ms"],
                "share_of_call_clock": (own["prefill_ms"] + own["decode_ms"]) / 1e3 / sum(
                    r[PLAIN]["seconds"] for r in rows if r[PLAIN].get("llama_perf")),
            } if own and own["prefill_ms"] > 0 and own["decode_ms"] > 0 else None,
            "tok_s": {n: sum(v) / len(v) if v else None for n, v in tok_s.items()},
            "per_prompt_tok_s": tok_s,
            "tokens": {n: sum(r[n]["tokens"] for r in rows) for n in names},
            "llama_cpp_tokens_identical": sum(same) / len(same) if same else None}


def run(rows: Sequence[Mapping[str, Any]],
        ours: Callable[[str, str], tuple[list[int], float, dict[str, Any]]],
        encode: Callable[[str], list[int]], eos: set[int], max_new: int, gamma: int,
        cache: Path, fingerprint: str) -> dict[str, Any]:
    """Every prompt of `rows` ({id, domain, prompt}) through memspec and target-only
    (`ours(prompt, policy)` -> (tokens, seconds, what the runtime said of the run: its
    own clock and split), EOS kept as the runtime returns it) and
    the three peers, interleaved per prompt; cached per prompt in `cache` (JSONL, keyed by
    `fingerprint`, the peers' own key and the prompt) so a re-render measures nothing."""
    llama = LlamaCpp(threads(), gamma)
    key = f"{fingerprint}|{llama.key()}|{max_new}|v{VERSION}"
    done: dict[str, dict[str, Any]] = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("key") == key:
                done[row["id"]] = row
    todo = [r for r in rows if r["id"] not in done]

    def one(name: str, prompt: str) -> Run:
        ids = encode(prompt)
        time.sleep(SETTLE_S)
        if name in OURS:
            toks, secs, said = ours(prompt, name)
            toks = toks[:-1] if toks and toks[-1] in eos else toks
            return {"tokens": len(toks), "seconds": secs, "ids": toks, "runtime": said}
        if name == PLAIN:
            run = timed(lambda: (len(got := llama.greedy(ids, max_new, eos)), got))
            return {**run, "llama_perf": llama.perf()}  # its own clocks, beside ours
        return timed(lambda: (llama.completion(ids, max_new, name == PY_LOOKUP), None))

    if todo:
        _log(f"{len(todo)} prompts x ({', '.join((*OURS, *PEERS))}), {llama.threads} threads "
             f"for llama.cpp, interleaved")
        for name in (*OURS, *PEERS):  # not measured (WARM_PROMPT)
            one(name, WARM_PROMPT)
        cache.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with cache.open("a") as f:
            for i, r in enumerate(todo):
                got = {n: one(n, r["prompt"]) for n in order(i, (*OURS, *PEERS))}
                row = {"key": key, "id": r["id"], "domain": r["domain"], **got}
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[r["id"]] = row
                left = (time.perf_counter() - t0) / (i + 1) * (len(todo) - i - 1)
                _log(f"{i + 1}/{len(todo)}: " + ", ".join(
                    f"{n} {g['tokens'] / g['seconds']:.0f}" for n, g in got.items()
                    if g["seconds"] > 0) + f" tok/s (~{left / 60:.1f} min left)")
    out = summarise([done[r["id"]] for r in rows])
    out.update(threads=llama.threads, gamma=gamma, max_new_tokens=max_new,
               gguf=llama.gguf.name, version=llama.lc.__version__,
               system_info=llama.system_info(),
               clock="call to last token, prefill included; the end-of-generation token "
                     "not counted")
    return out
