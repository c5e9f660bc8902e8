"""Runs inside the side environment of `python3 -m memspec.zoo.quantref` (never the project's):
GPTQModel quantises each job's model and then, as the reference, runs its own forward of
the folder it saved and dequantises a few of its layers. A plain script on purpose: it
imports GPTQModel, never memspec.

Usage: python quantref_worker.py JOBS.json   (see quantref.py for the fields); quantref.py
runs it in `$MEMSPEC_HOME/quantref/work`, where GPTQModel puts its `logs/`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def quantise(job: dict) -> None:
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig

    cls = AWQConfig if job["method"] == "awq" else GPTQConfig
    cfg = cls(**job["config"])
    model = GPTQModel.load(job["src"], cfg, device="cpu")
    calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in job["calibration"]]
    model.quantize(calib, batch_size=1)
    model.save(job["out"])


def reference(job: dict, probe: list[int], modules: list[str], out: Path) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import save_file

    backend = BACKEND.AWQ_TORCH if job["method"] == "awq" else BACKEND.TORCH
    model = GPTQModel.load(job["out"], device="cpu", backend=backend, dtype=torch.float16)
    inner = model.model
    ids = torch.tensor([probe])
    with torch.inference_mode():
        logits = inner(ids).logits[0].float()
    tensors = {"logits": logits.contiguous(), "ids": ids[0].to(torch.int64)}
    named = dict(inner.named_modules())
    for name in modules:
        mod = named.get(name)
        if mod is None:
            continue
        with torch.inference_mode():
            if hasattr(mod, "dequantize_weight"):  # GPTQ kernels
                w = mod.dequantize_weight()
            else:  # AWQ's torch kernel: GPTQModel's own GEMM dequantiser
                from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

                w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, 4, mod.group_size)
        tensors[f"dequant.{name}"] = w.t().contiguous().to(torch.float16)  # [out, in]
    save_file(tensors, str(out))


def main(path: str) -> int:
    spec = json.loads(Path(path).read_text())
    status = {}
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        try:
            if not (Path(job["out"]) / "config.json").is_file():
                quantise(job)
            quantised_s = time.perf_counter() - t0
            reference(job, spec["probe"], job["modules"], Path(job["reference"]))
            status[job["name"]] = {"ok": True, "quantise_s": round(quantised_s, 1),
                                   "total_s": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # noqa: BLE001 - reported per job, the others still run
            traceback.print_exc()
            status[job["name"]] = {"ok": False,
                                   "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        print(f"[quantref] {job['name']}: {status[job['name']]}", flush=True)
    Path(spec["status"]).write_text(json.dumps(status, indent=1))
    return 0 if all(s["ok"] for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
