"""A request's output grammar (a JSON schema, or any JSON object) as a token constraint.

The target emits, at every position, its most likely token *among those the grammar
allows* (greedy), or samples from its distribution restricted to them; speculation must not
change that, so each verify row is judged in the grammar state its accepted prefix leaves.
Drafts help in two ways: a proposal the grammar forbids ends the proposal there (it could
never be accepted), and tokens the grammar forces (braces, quotes, keys) are proposed with
no draft call at all (`forced`), so a constrained request can decode faster than a free one.

The grammar engine is llguidance (Microsoft's, the one llama.cpp, vLLM and SGLang ship):
compared on this project's 49k-token vocabulary (docs/notes/structured.md) it compiles a
schema in ~1 ms (outlines-core: 25-46 ms, a regex index per schema), computes a mask in
~30-140 us, covers JSON Schema's recursion, $ref and anyOf, has no dependencies (xgrammar
pulls torch and triton) and wheels for x86-64 and aarch64, and answers speculation's
questions directly: how many of these tokens are legal, which tokens are forced.

Pure logic: no sockets; the engine and the tests share it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memspec.common.errors import RequestError

# what `response_format` may ask for (OpenAI's names)
KINDS = ("json_object", "json_schema")
# JSON as `json.dumps` writes it: one space after ',' and ':' and nowhere else between
# tokens (a free whitespace rule lets a small model pad forever)
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


class GrammarTokenizer:
    """The target's vocabulary as llguidance reads it (built once per decoder: ~0.25 s)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int]) -> None:
        import llguidance

        # the added (special) tokens by text: a grammar names them by id
        self.token_ids = {t["content"]: int(t["id"]) for t in
                          json.loads(tokenizer_json).get("added_tokens", [])
                          if t.get("special")}
        self.vocab = int(vocab)
        self.eos = sorted(int(e) for e in eos_ids)
        self.lt = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab,
                                         eos_token=self.eos)

    @classmethod
    def of(cls, tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> GrammarTokenizer:
        """From the decoder's tokenizer: the `tokenizers` backend of a file tokenizer or of
        a transformers fast tokenizer (its tokenizer.json, added tokens included)."""
        backend = next((b for b in (getattr(tokenizer, "backend_tokenizer", None),
                                    getattr(tokenizer, "backend", None))
                        if hasattr(b, "to_str")), None)
        if backend is None:
            raise RequestError("this target's tokenizer has no tokenizer.json",
                               "structured output needs a fast (tokenizers) tokenizer")
        return cls(backend.to_str(), vocab, eos_ids)

    def compile(self, kind: str, schema: str = "") -> Constraint:
        """A fresh constraint for one request; a schema the compiler refuses is one line."""
        import llguidance

        if kind not in KINDS:
            raise RequestError(f"response format '{kind}' is not one of {', '.join(KINDS)}",
                               "ask for json_object or json_schema")
        if kind == "json_schema":
            try:
                parsed = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not JSON ({exc})",
                                   "send the schema as a JSON object") from None
            if not isinstance(parsed, dict):
                raise RequestError("the JSON schema is not an object",
                                   "send the schema as a JSON object") from None
        else:
            parsed = ANY_OBJECT
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(parsed,
                                                                   overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise RequestError(f"the JSON schema cannot be compiled ({exc})",
                               "send a JSON Schema (draft 2020-12) object") from None
        return self._matcher(grammar)

    def compile_tool_call(self, schema: dict[str, Any], open_tag: str, close_tag: str
                          ) -> Constraint:
        """One Hermes-format call (`tool_choice` required or named): the opening tag, a
        JSON call the schema accepts (common/toolcalls.py `call_schema`), the closing tag.
        A tag that is one special token of the vocabulary (Qwen2.5's) is that token."""
        import llguidance

        call = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        lark = (f"start: {self._literal(open_tag)} \"\\n\" call \"\\n\" "
                f"{self._literal(close_tag)}\ncall: %json {call}\n")
        return self._matcher(llguidance.LLMatcher.grammar_from_lark(lark))

    def _literal(self, text: str) -> str:
        """A Lark terminal for `text`: its token where the vocabulary has it as one special
        token, else the text."""
        tid = self.token_ids.get(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def _matcher(self, grammar: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.lt, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the JSON schema cannot be used: {_first_line(matcher.get_error())}",
                               "send a JSON Schema (draft 2020-12) the grammar compiler "
                               "supports") from None
        return Constraint(matcher, self.vocab, self.eos)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


class Constraint:
    """One request's grammar state: what the target may emit next."""

    def __init__(self, matcher: Any, vocab: int, eos: Sequence[int]) -> None:
        self.m = matcher
        self.vocab = vocab
        self.eos = frozenset(eos)
        self._words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self.seconds = 0.0  # time spent in the grammar (the bench reports it per token)
        self.masks = 0  # full masks computed (the model's own choice was legal elsewhere)

    # ---- questions speculation asks ---------------------------------------------------
    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the current state on, the grammar allows."""
        if not tokens:
            return 0
        if self.m.is_stopped():  # (llguidance's check refuses even the end of sequence there)
            return int(tokens[0] in self.eos)
        t0 = time.perf_counter()
        n = int(self.m.validate_tokens(list(tokens)))
        self.seconds += time.perf_counter() - t0
        return n

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (empty where it leaves a choice)."""
        t0 = time.perf_counter()
        ff = [int(t) for t in self.m.compute_ff_tokens()]
        self.seconds += time.perf_counter() - t0
        return ff

    def allowed(self) -> np.ndarray:
        """The mask of legal next tokens, one bool per target vocabulary entry."""
        t0 = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab]
        self.masks += 1
        self.seconds += time.perf_counter() - t0
        return bits.astype(bool)

    # ---- choosing and committing -------------------------------------------------------
    def pick_greedy(self, row: np.ndarray, first: int | None = None) -> int:
        """The row's argmax among legal tokens. The unconstrained argmax (`first`, computed
        by the caller where it has it) is the answer whenever it is legal, the usual case,
        and costs one token check instead of a whole mask (ties resolve alike: the first
        maximum)."""
        top = int(row.argmax()) if first is None else first
        if self.legal_prefix([top]) == 1:
            return top
        masked = np.where(self.allowed(), row, -np.inf)
        if not np.isfinite(masked).any():  # (the grammar allows nothing: end the text)
            raise RequestError(f"the grammar allows no token here: {self.error() or 'dead end'}",
                               "check the schema; it may be unsatisfiable")
        return int(masked.argmax())

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """A row with forbidden tokens at -inf (sampling draws from the legal ones)."""
        allowed = torch.from_numpy(self.allowed())
        return logits.masked_fill(~allowed[:logits.shape[-1]], float("-inf"))

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past emitted tokens (each was legal where it was chosen)."""
        if not tokens:
            return
        t0 = time.perf_counter()
        # one at a time: a batch refuses the end of sequence once the grammar has stopped
        ok = all(self.m.consume_token(int(t)) for t in tokens)
        self.seconds += time.perf_counter() - t0
        if not ok:
            raise RequestError(f"the grammar refused an emitted token: {self.error()}",
                               "report this: every emitted token is checked first")

    def error(self) -> str:
        return _first_line(self.m.get_error()) if self.m.is_error() else ""
