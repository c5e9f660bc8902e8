"""GPTQ / AWQ int4 folders read into the engine's blocks (procs/decoder/forward/quantized.py).

The folders here are packed as the reference implementations pack them (tests/quantpack.py
follows AutoGPTQ's and AutoAWQ's packing loops), from known codes, so what the reader gives
back can be checked bit for bit; tests/test_quantized_reference.py checks the same against
folders GPTQModel itself wrote and its own forward of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quantpack import pack_gptq, rtn, write_quantised
from safetensors.torch import load_file, save_file
from tinymodels import make_tiny, save_model

from memspec.common.errors import ModelError
from memspec.common.manifest import check_folder, write_manifest
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.checkpoint import lean_arch, load_state_dict, read_config
from memspec.procs.decoder.forward.lean import LeanLM, projection_shapes
from memspec.procs.decoder.forward.linear import Int4Linear, PermutedLinear
from memspec.procs.decoder.forward.native import NativeLM
from memspec.procs.decoder.forward.precision import resolve_dtype
from memspec.procs.decoder.forward.quantized import (
    quant_format,
    read_codes,
    split_weights,
    unpack_gptq_zeros,
)
from memspec.procs.decoder.models import build_target
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

VARIANTS = {  # name: (method, group, sym, desc_act, v1)
    "gptq-actorder-asym": ("gptq", 64, False, True, True),
    "gptq-sym": ("gptq", 32, True, False, True),
    "gptq-v2-asym": ("gptq", 128, False, False, False),
    "gptq-perchannel": ("gptq", -1, False, False, True),
    "awq": ("awq", 64, False, False, True),
}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    """A tiny Llama wide enough for 32-input blocks and 128-input groups."""
    root = tmp_path_factory.mktemp("qsrc")
    return save_model(make_tiny(0, hidden=128, layers=2), root / "src")


@pytest.fixture(scope="module")
def folders(tiny_src, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("quantised")
    out = {}
    for name, (method, group, sym, desc, v1) in VARIANTS.items():
        layers = write_quantised(tiny_src, root / name, method, group, sym, desc, v1)
        out[name] = (root / name, layers)
    return out


def _arch_and_weights(folder: Path):
    return lean_arch(read_config(folder)), load_state_dict(folder)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_layer_reads_back_as_the_codes_mean_bit_for_bit(folders, name):
    """Unpacking (nibble order, AWQ's interleave, v1's zero - 1, g_idx) gives exactly
    w = s * (q - z): compared as fp32, where that product is exact."""
    folder, layers = folders[name]
    fmt = quant_format(folder)
    arch, weights = _arch_and_weights(folder)
    shapes = projection_shapes(arch)
    for module, layer in layers.items():
        n, k = shapes[module.rsplit(".", 1)[-1]]
        codes = read_codes(fmt, module, weights, n, k)
        assert torch.equal(codes.q.long(), layer.q.long()), module
        assert torch.equal(codes.dequantize(), layer.weight()), module


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_blocks_are_the_checkpoint_up_to_the_fp16_min(folders, name):
    """d = s, m = -s * z per 32-input block: symmetric folders exactly, asymmetric ones
    within fp16's rounding of m (|error| <= 2^-11 |s z|); act-order layers are the same
    weights with permuted columns (and gate/up rows where down's gather moved into them)."""
    folder, layers = folders[name]
    method, group, sym, desc, _ = VARIANTS[name]
    fmt = quant_format(folder)
    arch, weights = _arch_and_weights(folder)
    _, built = split_weights(fmt, arch, weights, torch.float32)
    for i in range(arch.layers):
        p = f"model.layers.{i}"
        down = layers[f"{p}.mlp.down_proj"]
        rows = torch.argsort(down.g_idx.long(), stable=True) if desc else None
        for module in (m for m in layers if m.startswith(p + ".")):
            lin = built[module]
            want, ref = layers[module], layers[module].weight()
            g = want.g_idx.long()
            bound = 2.0 ** -11 * (want.scales.float()[g] * want.zeros.float()[g]).t().abs()
            if desc and module.endswith("down_proj"):  # its gather moved into gate / up
                assert isinstance(lin, Int4Linear)
                got = torch.empty_like(ref)
                got[:, rows] = lin.dequantize()
            elif desc:
                assert isinstance(lin, PermutedLinear)
                got = lin.dequantize()
                if module.endswith(("gate_proj", "up_proj")):
                    ref, bound = ref[rows], bound[rows]
            else:
                assert isinstance(lin, Int4Linear)
                got = lin.dequantize()
            err = (got - ref).abs()
            if sym:
                assert torch.equal(got, ref), module
            else:
                assert bool((err <= bound).all()), (module, float((err - bound).max()))


def test_v1_zeros_undo_the_minus_one_word_wide_as_gptqmodel_does():
    """v1 zero words are the v2 words minus 0x11111111 (GPTQModel's save; AutoGPTQ's
    ``zeros -= 1`` per nibble is the same where nothing wraps). A zero of 0 borrows from
    the next nibble; adding 0x11111111 back undoes it exactly, also in the top nibble."""
    zeros = torch.tensor([[0, 5, 15, 8, 0, 1, 2, 0]], dtype=torch.int64)
    v2 = sum(int(z) << (4 * j) for j, z in enumerate(zeros[0]))
    v1 = (v2 - 0x11111111) % 2**32
    word = torch.tensor([[v1 - 2**32 if v1 >= 2**31 else v1]], dtype=torch.int32)
    assert torch.equal(unpack_gptq_zeros(word, v1=True).long(), zeros)
    v2_word = torch.tensor([[v2 - 2**32 if v2 >= 2**31 else v2]], dtype=torch.int32)
    assert torch.equal(unpack_gptq_zeros(v2_word, v1=False).long(), zeros)


def test_the_test_packer_puts_input_8r_plus_j_in_nibble_j():
    """AutoGPTQ's layout, checked on one hand-read word of tests/quantpack.py's packer:
    qweight[r, n] holds inputs 8r..8r+7 of output n, input 8r+j in bits 4j..4j+3."""
    layer = rtn(torch.randn(8, 32), 32, False, False)
    layer.q = (torch.arange(256, dtype=torch.int32) * 7 % 16).view(8, 32)
    word = int(pack_gptq(layer, v1=True)["qweight"][1, 3]) % 2**32
    assert [(word >> (4 * j)) & 15 for j in range(8)] == layer.q[3, 8:16].tolist()


@pytest.mark.parametrize("name", ["gptq-actorder-asym", "gptq-sym", "awq"])
def test_int4_forward_agrees_with_the_exact_dequantised_forward(folders, name):
    """The engine's int4 target (block kernels, int8 activations per 32 values, a Q8_0 LM
    head) against the eager HF forward of the exact dequantised weights (dtype float32):
    the same model up to the kernels' own rounding."""
    folder, _ = folders[name]
    ids = torch.tensor([1, 5, 9, 33, 17, 4, 60, 2, 7, 8, 11, 90, 3, 14, 15, 92])
    got = {}
    for dtype in ("int4", "float32"):
        runner = build_target(folder, dtype)
        with torch.inference_mode():
            got[dtype] = runner.forward(ids, 0, runner.new_cache(64)).float()
    scale = got["float32"].std()
    diff = (got["int4"] - got["float32"]).abs()
    assert float(diff.mean()) < 0.03 * float(scale), float(diff.mean())
    agree = (got["int4"].argmax(-1) == got["float32"].argmax(-1)).float().mean()
    assert agree >= 0.85


def test_runner_choice_native_unless_act_order_needs_a_gather(folders):
    plain = build_target(folders["gptq-sym"][0], "int4")
    actorder = build_target(folders["gptq-actorder-asym"][0], "int4")
    if isinstance(plain, NativeLM):  # where the C++ forward is built
        assert plain.exact_chunks  # every layer is one of the block kernels
    assert isinstance(actorder, LeanLM)
    assert resolve_dtype("auto", folders["awq"][0], "cpu") == "int4"


@pytest.mark.parametrize("target_name,draft_name", [("gptq-sym", None),
                                                     ("gptq-actorder-asym", "awq"),
                                                     ("awq", "gptq-v2-asym")])
def test_speculative_output_equals_target_only_on_a_quantised_target(folders, tiny_src,
                                                                     target_name, draft_name,
                                                                     tmp_path):
    """Greedy decoding with a draft (a dense one, or a quantised model draft bound from a
    slot) gives the GPTQ / AWQ target's own target-only tokens."""
    target = build_target(folders[target_name][0], "int4")
    eng = SpecEngine(target, (), gamma=4)
    if draft_name is None:
        draft_dir = save_model(make_tiny(3, hidden=128, layers=1), tmp_path / "draft")
    else:
        draft_dir = folders[draft_name][0]
    eng.add_draft(load_into_slot("d", draft_dir, SlotBuffer(8 << 20), eng.vocab))
    for prompt in ([1, 5, 9, 33], [7, 7, 7, 20, 21, 22, 23]):
        ref, _ = eng.generate(prompt, 24)
        out, stats = eng.generate(prompt, 24, select=lambda s: "d")
        assert out == ref
        assert stats.summary()["num_draft_tokens"] > 0


def _broken(folders, tmp_path: Path, base: str, edit) -> Path:
    src, _ = folders[base]
    out = tmp_path / "broken"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    sd = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    edit(sd, cfg)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


Q = "model.layers.0.self_attn.q_proj"
BROKEN = {  # name: (base folder, edit, what the one line must name)
    "missing qzeros": ("gptq-sym", lambda sd, c: sd.pop(f"{Q}.qzeros"),
                       ["GPTQ", f"'{Q}.qzeros' is missing"]),
    "bits 8": ("gptq-sym", lambda sd, c: c["quantization_config"].update(bits=8),
               ["GPTQ", "quantization_config.bits = 8"]),
    "g_idx out of range": ("gptq-actorder-asym",
                           lambda sd, c: sd[f"{Q}.g_idx"].__setitem__(5, 99),
                           ["GPTQ", f"'{Q}.g_idx' holds group 99", "outside the 2 groups"]),
    "scales shape": ("awq", lambda sd, c: sd.update({f"{Q}.scales": sd[f"{Q}.scales"][:1]}),
                     ["AWQ", f"'{Q}.scales' has shape (1, 128)", "needs (2, 128)"]),
    "group size disagrees": ("gptq-sym",
                             lambda sd, c: c["quantization_config"].update(group_size=64),
                             ["GPTQ", ".scales' has shape (", "with group_size 64 needs"]),
    "unknown method": ("gptq-sym",
                       lambda sd, c: c["quantization_config"].update(quant_method="hqq"),
                       ["quantization_config.quant_method 'hqq'"]),
    "awq gemv": ("awq", lambda sd, c: c["quantization_config"].update(version="gemv"),
                 ["AWQ", "quantization_config.version = 'gemv'"]),
    "marlin": ("gptq-sym", lambda sd, c: c["quantization_config"].update(
        checkpoint_format="marlin"), ["GPTQ", "checkpoint_format = 'marlin'"]),
    "float codes": ("gptq-sym", lambda sd, c: sd.update({f"{Q}.qweight": sd[f"{Q}.qweight"]
                                                         .float()}),
                    ["GPTQ", f"'{Q}.qweight' is float32"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("dtype", ["int4", "float32"])
def test_a_folder_it_cannot_read_is_refused_in_one_line(folders, tmp_path, case, dtype):
    base, edit, words = BROKEN[case]
    folder = _broken(folders, tmp_path, base, edit)
    with pytest.raises(ModelError) as err:
        build_target(folder, dtype)
    msg = str(err.value)
    assert "\n" not in msg and str(folder) in msg
    for w in words:
        assert w in msg, msg


def test_the_cli_refuses_a_broken_folder_in_one_line(folders, tmp_path):
    base, edit, words = BROKEN["missing qzeros"]
    folder = _broken(folders, tmp_path, base, edit)
    pool = tmp_path / "pool.toml"
    pool.write_text(f'[pool]\ntarget = "{folder}"\n')
    res = subprocess.run([sys.executable, "-m", "memspec", "generate", "--in-process",
                          "--pool", str(pool), "--policy", "target-only", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("memspec: error: GPTQ folder"), res.stderr
    assert words[1] in lines[-1]


def test_manifest_covers_packed_tensors(folders, tmp_path):
    """`memspec manifest DIR` on a GPTQ folder: every packed tensor has its own range, and
    a flipped byte in one is named."""
    src, _ = folders["gptq-actorder-asym"]
    folder = tmp_path / "m"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    man = json.loads(write_manifest(folder).read_text())
    names = {t[0] for t in man["weights"]["model.safetensors"]["tensors"]}
    assert {f"{Q}.qweight", f"{Q}.qzeros", f"{Q}.scales", f"{Q}.g_idx"} <= names
    assert check_folder(folder) == []
    entry = next(t for t in man["weights"]["model.safetensors"]["tensors"]
                 if t[0] == f"{Q}.qzeros")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[man["weights"]["model.safetensors"]["data_offset"] + entry[1]] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    problems = check_folder(folder)
    assert len(problems) == 1 and f"'{Q}.qzeros'" in problems[0]


@pytest.mark.parametrize("name", ["gptq-sym", "gptq-actorder-asym", "awq"])
def test_bench_floor_passes_over_the_checkpoints_own_layers(folders, tmp_path, name):
    """`memspec bench engine --target DIR`'s floor: the folder's own int4 layers (an
    act-order layer with its gather), not a requantisation of dense weights."""
    from memspec.bench.engine import floor_fns
    from memspec.common.config import load_pool

    pool = tmp_path / "pool.toml"
    pool.write_text(f'[pool]\ntarget = "{folders[name][0]}"\n')
    floor_fns(load_pool(str(pool)), "int4", 2)()
