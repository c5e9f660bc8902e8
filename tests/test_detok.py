"""Streaming text: the pieces add up to the full decode, with bounded work per token."""

from __future__ import annotations

import random

import pytest

from memspec.procs.decoder.detok import StreamDecoder


def _tokenizer():
    from memspec.common.paths import default_target_dir
    from memspec.procs.decoder.models import load_tokenizer

    path = default_target_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("converted target not built (memspec zoo target)")
    return load_tokenizer(path)


TEXTS = ["Hello, world! Grüße aus Köln — naïve café. 你好，世界。 🙂🚀 x² ≤ ∑ αβγ",
         "def f(x):\n    return x ** 2  # square\n\n\tIndented\ttabs  and  spaces",
         "The dose is 5 mg/kg × 3 = 15 mg/kg per day; ±0.5 °C, 10 µL, 3½ cups."]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_stream_pieces_add_up_to_the_full_decode(chunk):
    tok = _tokenizer()
    rng = random.Random(chunk)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        ids = ids + [rng.randrange(200, 40000) for _ in range(40)]  # arbitrary tails too
        dec = StreamDecoder(tok)
        out = "".join(dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
        out += dec.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_work_per_push_is_bounded():
    tok = _tokenizer()
    calls = []
    real = tok.decode

    def spy(ids, **kw):
        calls.append(len(ids))
        return real(ids, **kw)

    tok.decode = spy
    dec = StreamDecoder(tok)
    ids = tok(" ".join(["word"] * 400))["input_ids"]
    for t in ids:
        dec.push([t])
    assert max(calls) <= 12  # a window, never the whole output
