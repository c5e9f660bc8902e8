"""Structured output and log-probabilities on the real demo target (in process; the pipeline
and the OpenAI client are in test_http.py): under a JSON schema every policy emits exactly
constrained target-only's tokens and the text parses and validates; a draft never puts a
forbidden token into a verify; forced tokens are proposed without a draft; each token's
log-probability is the same with and without speculation; bad schemas are one line."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import torch
from test_pipeline import BASE_POOL, _ready_pool

from memspec.common.config import load_pool
from memspec.common.errors import RequestError
from memspec.common.limits import LimitError, check_request
from memspec.common.messages import Submit
from memspec.procs.decoder.inprocess import build_local
from memspec.procs.decoder.models import encode_prompt
from memspec.procs.decoder.sched.constraint import Constraint, GrammarTokenizer
from memspec.procs.decoder.sched.costs import LOOKUP

S = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a fictional person as JSON.",
     {"type": "object", "properties": {"name": S, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("Give a city and its country as JSON.",
     {"type": "object", "properties": {"city": S, "country": S},
      "required": ["city", "country"], "additionalProperties": False}),
    ("List three fruits as JSON.",
     {"type": "object", "properties": {"fruits": {"type": "array", "items": S,
                                                  "minItems": 3, "maxItems": 3}},
      "required": ["fruits"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                       "confidence": {"type": "number"}},
      "required": ["answer", "confidence"], "additionalProperties": False}),
    ("Describe a book as JSON.",
     {"type": "object", "properties": {
         "title": S, "author": {"type": "object", "properties": {"first": S, "last": S},
                                "required": ["first", "last"], "additionalProperties": False},
         "year": {"type": "integer"}},
      "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Give a point on a plane as JSON.",
     {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
      "required": ["x", "y"], "additionalProperties": False}),
    ("Rate the movie Titanic as JSON.",
     {"type": "object", "properties": {"movie": S, "stars": {"enum": [1, 2, 3, 4, 5]},
                                       "recommended": {"type": "boolean"}},
      "required": ["movie", "stars", "recommended"], "additionalProperties": False}),
    ("Write a Python function as JSON with its name and arguments.",
     {"type": "object", "properties": {"name": S, "args": {"type": "array", "items": S,
                                                          "maxItems": 3}},
      "required": ["name", "args"], "additionalProperties": False}),
    ("Give two colors with their hex codes as JSON.",
     {"type": "object", "properties": {"colors": {
         "type": "array", "maxItems": 2, "minItems": 2,
         "items": {"type": "object", "properties": {"name": S, "hex": S},
                   "required": ["name", "hex"], "additionalProperties": False}}},
      "required": ["colors"], "additionalProperties": False}),
    ("Describe the weather today as JSON.",
     {"type": "object", "properties": {"kind": {"enum": ["sunny", "rainy", "cloudy"]},
                                       "temperature": {"type": "integer"},
                                       "wind": {"type": "object", "properties": {
                                           "speed": {"type": "number"}, "dir": S},
                                           "required": ["speed", "dir"],
                                           "additionalProperties": False}},
      "required": ["kind", "temperature", "wind"], "additionalProperties": False}),
]
MAX_NEW = 96


@pytest.fixture(scope="module")
def rt():
    _ready_pool()
    local = build_local(load_pool(BASE_POOL))
    local.ensure_resident(local.pool.general)
    local.grammar = GrammarTokenizer.of(local.tokenizer, local.engine.vocab,
                                        local.engine.eos_ids)
    return local


def _run(rt, prompt: str, select, constraint: Constraint | None = None,
         logprobs: int | None = None, max_new: int = MAX_NEW, heads: bool = False):
    """`heads`: the model draft runs where the lookup would run in its place (on a CPU
    under a grammar it always would): the head's own proposals meet the grammar, as on
    a GPU."""
    ids = encode_prompt(rt.tokenizer, prompt)
    with torch.inference_mode():
        s = rt.engine.start(ids, max_new, None, constraint=constraint, logprobs=logprobs)
        s.force_ahead = select is not None
        if heads:
            s._lookup_first = 0
        while not s.done:
            s.step(select(s) if select else None)
    return s.generated, s.stats


def test_every_policy_emits_constrained_target_onlys_tokens_and_the_json_validates(rt):
    general = rt.pool.general
    forced = 0
    for prompt, schema in SCHEMAS:
        runs = {}
        for name, select, heads in (("target-only", None, False),
                                    ("lookup", lambda s: LOOKUP, False),
                                    ("general", lambda s: general, False),
                                    ("general-drafting", lambda s: general, True)):
            tokens, stats = _run(rt, prompt, select,
                                 rt.grammar.compile("json_schema", json.dumps(schema)),
                                 heads=heads)
            runs[name] = tokens
            if name == "target-only":
                assert stats.forced == 0  # the baseline proposes nothing
            forced += stats.forced
        assert runs["lookup"] == runs["target-only"] == runs["general"] \
            == runs["general-drafting"], prompt
        text = rt.tokenizer.decode(runs["target-only"], skip_special_tokens=True)
        assert runs["target-only"][-1] in rt.engine.eos_ids, (prompt, text)  # it ended
        jsonschema.validate(json.loads(text), schema)
    assert forced > 0  # braces, quotes and keys went out without a draft


def test_a_long_forced_run_is_one_verify_with_the_same_tokens(rt):
    """A key the grammar spells out whole (more tokens than gamma) goes out in one verify:
    every forced token is accepted, and the answer is target-only's."""
    from memspec.procs.decoder.engine import FORCED_MAX

    key = "the_name_of_the_principal_character_in_the_story"
    schema = {"type": "object", "properties": {key: S}, "required": [key],
              "additionalProperties": False}
    runs = {}
    for name, select in (("target-only", None), ("lookup", lambda s: LOOKUP)):
        runs[name] = _run(rt, "Describe a fictional person as JSON.", select,
                          rt.grammar.compile("json_schema", json.dumps(schema)))
    (base, _), (tokens, stats) = runs["target-only"], runs["lookup"]
    assert tokens == base
    gamma = rt.engine.gamma
    longest = max(r.proposed for r in stats.records)
    assert gamma < longest <= FORCED_MAX + gamma  # (forced, then the lookup's chain)
    first = stats.records[0]  # `{"` and the whole key: forced from the first position
    assert first.proposed > gamma and first.accepted >= first.proposed - gamma


def test_sampling_under_a_schema_draws_only_legal_tokens(rt):
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    prompt, schema = SCHEMAS[0]
    ids = encode_prompt(rt.tokenizer, prompt)
    outs = []
    for seed in (7, 7, 8):
        with torch.inference_mode():
            tokens, _ = rt.engine.generate(
                ids, MAX_NEW, SamplingParams(temperature=0.9, seed=seed), lambda s: LOOKUP,
                constraint=rt.grammar.compile("json_schema", json.dumps(schema)))
        text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
        if tokens[-1] in rt.engine.eos_ids:
            jsonschema.validate(json.loads(text), schema)
        else:  # (out of tokens: still a prefix the grammar allows)
            assert text.startswith('{"name": ')
        outs.append(tokens)
    assert outs[0] == outs[1]  # a seed repeats


def test_json_object_mode_gives_an_object(rt):
    tokens, _ = _run(rt, "Describe a cat as JSON.", lambda s: LOOKUP,
                     rt.grammar.compile("json_object"), max_new=200)
    text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text.startswith("{")
    if tokens[-1] in rt.engine.eos_ids:  # (a free object may be longer than the budget)
        assert isinstance(json.loads(text), dict)


def test_no_verify_holds_a_token_the_grammar_forbids(rt, monkeypatch):
    """Every proposal that reaches a verify is legal where it stands: the grammar's check
    of the proposals (and only accepted tokens advance it)."""
    prompt, schema = SCHEMAS[2]
    seen: list[tuple[list[int], int]] = []
    target = rt.engine.target
    forward = target.forward
    c = rt.grammar.compile("json_schema", json.dumps(schema))

    def spy(tokens, pos, cache, **kw):
        if tokens.numel() > 1 and not kw.get("last_only"):  # a verify (not the prefill)
            props = tokens[1:].tolist()
            seen.append((props, c.legal_prefix(props)))
        return forward(tokens, pos, cache, **kw)

    monkeypatch.setattr(target, "forward", spy)
    _, stats = _run(rt, prompt, lambda s: rt.pool.general, c, heads=True)
    assert seen and all(n == len(p) for p, n in seen)
    assert stats.report().drafts_used.get(rt.pool.general, 0) > 0  # the head drafted


def test_logprobs_are_the_same_with_and_without_speculation(rt):
    prompt = "Write a Python function that returns the factorial of n."
    base, stats = _run(rt, prompt, None, logprobs=3, max_new=48)
    ref = stats.token_logprobs
    assert [t for t, _, _ in ref] == base
    for t, lp, top in ref:  # greedy: the emitted token is the most likely one
        assert lp <= 0 and top[0][0] == t and abs(top[0][1] - lp) < 1e-6
        assert top[0][1] >= top[1][1] >= top[2][1]
    for select in (lambda s: LOOKUP, lambda s: rt.pool.general):
        tokens, st = _run(rt, prompt, select, logprobs=3, max_new=48, heads=True)
        assert tokens == base
        got = st.token_logprobs
        assert len(got) == len(ref)
        for (t, lp, top), (t2, lp2, top2) in zip(ref, got):
            assert t == t2 and abs(lp - lp2) < 2e-3
            assert abs(top[0][1] - top2[0][1]) < 2e-3
    _, none = _run(rt, prompt, None, max_new=4)
    assert none.token_logprobs == []


def test_bad_schemas_and_formats_are_one_line(rt):
    for bad, word in (("{not json", "not JSON"), ("[1, 2]", "not an object"),
                      (json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
                       "schema")):
        with pytest.raises(RequestError) as e:
            rt.grammar.compile("json_schema", bad)
        assert word in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RequestError):
        rt.grammar.compile("yaml")
    for fields, field in (({"response_format": "yaml"}, "response_format"),
                          ({"response_format": "json_schema"}, "json_schema"),
                          ({"json_schema": "{}"}, "json_schema"),
                          ({"logprobs": 21}, "logprobs")):
        with pytest.raises(LimitError) as e:
            check_request(Submit(req_id="r", prompt="x", **fields))
        assert e.value.field == field
    check_request(Submit(req_id="r", prompt="x", response_format="json_object", logprobs=20))


def test_generate_cli_json_schema_in_process(rt, tmp_path):
    prompt, schema = SCHEMAS[1]
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    ref, _ = _run(rt, prompt, None, rt.grammar.compile("json_schema", json.dumps(schema)))
    cmd = [sys.executable, "-m", "memspec.launch.cli", "generate", "--pool", str(BASE_POOL),
           "--in-process", "--policy", "lookup-only", "--max-new-tokens", str(MAX_NEW)]
    res = subprocess.run([*cmd, "--json-schema", str(f), "--logprobs", "1", "--json", prompt],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_ids"] == ref
    jsonschema.validate(json.loads(out["text"]), schema)
    assert len(out["logprobs"]) == len(ref) and len(out["logprobs"][0]["top"]) == 1
    res = subprocess.run([*cmd, "--json-schema", str(tmp_path / "missing.json"), prompt],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "cannot read the JSON Schema" in res.stderr
