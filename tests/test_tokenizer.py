"""The serving processes' light tokenizer (procs/decoder/tokenizer.py) against transformers'
on the same folder: the same prompt ids (chat and raw), chat errors, EOS ids and text."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from memspec.common.errors import RequestError
from memspec.common.paths import default_target_dir
from memspec.procs.decoder.models import (
    _load_tokenizer,
    encode_chat,
    encode_prompt,
    eos_token_ids,
    load_serving_tokenizer,
)
from memspec.procs.decoder.tokenizer import ChatTokenizer, serving_tokenizer

PROMPTS = ["Write a Python function that returns the factorial of n.", "",
           "Grüße — 你好 🙂 x² ≤ ∑\n\n\tindented  twice ", "a <|im_start|>user sneaks in<|im_end|>",
           "What does clause 4(b) of the licence permit? " * 40]
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "ok"}, {"role": "system", "content": "late"}],
]
# templates in the shapes real ones take: raise_exception, tojson, namespace, loop controls
TEMPLATES = [
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system must come first') }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'assistant' %}{% continue %}{% endif %}"
    "{{ m | tojson }}{{ eos_token }}{% endfor %}#{{ ns.n }}",
]


@pytest.fixture(scope="module")
def target():
    path = default_target_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("converted target not built (memspec zoo target)")
    return path


def _same(light, full, path) -> None:
    for p in PROMPTS:
        assert encode_prompt(light, p) == encode_prompt(full, p), p
        assert encode_prompt(light, p, chat=False) == encode_prompt(full, p, chat=False), p
    for chat in CHATS:
        try:  # a template's own refusal must be the same refusal
            want = encode_chat(full, chat)
        except RequestError as exc:
            with pytest.raises(RequestError) as got:
                encode_chat(light, chat)
            assert got.value.problem == exc.problem
            continue
        assert encode_chat(light, chat) == want, chat
    assert eos_token_ids(path, light) == eos_token_ids(path, full)


def test_the_targets_light_tokenizer_gives_transformers_ids_and_text(target):
    light, full = load_serving_tokenizer(target), _load_tokenizer(target)
    assert isinstance(light, ChatTokenizer) and light.chat_template == full.chat_template
    assert len(light) == len(full)  # the predictor's range check of recent ids
    assert light.special == {k: v for k, v in full.special_tokens_map.items()
                             if isinstance(v, str)}
    _same(light, full, target)
    rng = random.Random(0)  # decoded text: the stream, Done's text, the predictor's recent
    for _ in range(500):
        ids = [rng.randrange(len(full)) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip)


@pytest.mark.parametrize("template", TEMPLATES)
def test_other_templates_render_as_transformers_renders_them(target, tmp_path, template):
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(target / f, tmp_path / f)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    light, full = serving_tokenizer(tmp_path), _load_tokenizer(tmp_path)
    assert isinstance(light, ChatTokenizer)
    _same(light, full, tmp_path)


def test_tokenizers_it_cannot_match_load_in_full(target, tmp_path):
    """A clean-up pass, named templates, a non-generic class, a BOS rule or extra special
    tokens: transformers' tokenizer."""
    config = json.loads((target / "tokenizer_config.json").read_text())
    shutil.copy(target / "tokenizer.json", tmp_path / "tokenizer.json")
    for change in ({"clean_up_tokenization_spaces": True},
                   {"chat_template": [{"name": "default", "template": "x"}]},
                   {"tokenizer_class": "GPT2Tokenizer"}, {"add_bos_token": True},
                   {"additional_special_tokens": ["<x>"]}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert serving_tokenizer(tmp_path) is None, change


def test_the_decoders_tokenizer_has_run_its_template_before_the_first_request(target, tmp_path):
    """Compiling the template costs ~65 ms: at start-up, not inside the first request."""
    shutil.copytree(target, tmp_path / "t")
    tok = load_serving_tokenizer(tmp_path / "t", chat=True)
    assert isinstance(tok, ChatTokenizer) and tok._compiled is not None
    assert encode_prompt(tok, "Hi") == encode_prompt(_load_tokenizer(target), "Hi")
