"""GPTQ and AWQ checkpoints written by a real implementation, and its own outputs on them.

`python3 -m memspec.zoo.quantref [--only NAMES] [--timeout S]` makes, under
`$MEMSPEC_HOME/quantref/`:
- `venv/`: a side virtual environment (system site packages visible, nothing installed
  into the project's) holding GPTQModel and its small pure-Python dependencies, pinned;
- one folder per job: the pool's small draft model (`drafts/models/general`) quantised by
  GPTQModel as GPTQ with act order and asymmetric zeros, as symmetric GPTQ in groups of 32,
  and as AWQ (GEMM packing); and the demo target quantised as GPTQ with GPTQModel's defaults
  (group 128, symmetric, act-group-aware order);
- `<job>.reference.safetensors`: GPTQModel's own forward of the saved folder (its torch
  kernels, fp16) on a fixed prompt, and its dequantisation of a few layers;
- `status.json`: what ran, how long, and every failure's exact error (or why the side
  environment could not be made);
- `work/`: each job's output (`<job>.log`) and GPTQModel's own `logs/` (it writes them
  under its working directory, which is this one, never the caller's).

`launch/setup.sh --dev` runs it, so CI has them; the test suite compares the engine against
these (tests/test_quantized_reference.py) and skips, printing why and naming this command,
where they are missing. About 3.5 minutes on 2 CPU cores from nothing, pip's cache empty
(the side environment under a minute, the target's quantisation 1.5 minutes); jobs already
done are kept, so a rerun takes seconds. Progress goes to stderr; stdout gets one line:
where the checkpoints are, or why they are not (exit status 1 or 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

from memspec.common.errors import MemspecError
from memspec.common.paths import PACKAGE_ROOT, default_target_dir, memspec_home

# GPTQModel and what it imports that the project's environment lacks (torch, transformers,
# accelerate and safetensors come from the project's); --no-deps keeps pip from upgrading
# those (GPTQModel asks for a newer torch than it needs for CPU quantisation)
PINNED = ("gptqmodel==7.7.0", "pypcre==0.6.4", "logbar==0.4.15", "tokenicer==0.0.14",
          "device-smi==0.5.7", "threadpoolctl==3.8.0", "defuser==0.0.28", "dill==0.4.1")
COMMAND = "python3 -m memspec.zoo.quantref"
PROBE_PROMPT = "Write a Python function that returns the factorial of n, and explain it."
DRAFT = PACKAGE_ROOT / "drafts" / "models" / "general"
LAYERS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def home() -> Path:
    return memspec_home() / "quantref"


def _log(msg: str) -> None:
    print(f"[quantref] {msg}", file=sys.stderr, flush=True)


def jobs() -> dict[str, dict]:
    """name -> (source, method, GPTQModel config, layers to dequantise)."""
    draft_layers = [f"model.layers.{i}.{p}" for i in (0, 1) for p in LAYERS]
    target_layers = [f"model.layers.{i}.{p}" for i in (0, 29) for p in LAYERS]
    return {
        "draft-gptq-actorder": {"src": "draft", "method": "gptq", "modules": draft_layers,
                                "config": {"bits": 4, "group_size": 128, "desc_act": True,
                                           "act_group_aware": False, "sym": False}},
        "draft-gptq-sym-g32": {"src": "draft", "method": "gptq", "modules": draft_layers,
                               "config": {"bits": 4, "group_size": 32, "desc_act": False,
                                          "sym": True}},
        "draft-awq": {"src": "draft", "method": "awq", "modules": draft_layers,
                      "config": {"bits": 4, "group_size": 128, "sym": False}},
        "target-gptq": {"src": "target", "method": "gptq", "modules": target_layers,
                        "config": {"bits": 4, "group_size": 128}},
    }


def venv_python() -> Path:
    return home() / "venv" / "bin" / "python"


def ensure_venv(timeout: float) -> Path:
    """The side environment, made once (bounded by ``timeout`` seconds)."""
    py = venv_python()
    stamp = home() / "venv" / "memspec-pinned.txt"
    if py.is_file() and stamp.is_file() and stamp.read_text() == "\n".join(PINNED):
        return py
    shutil.rmtree(home() / "venv", ignore_errors=True)
    _log(f"creating the side environment {home() / 'venv'} (GPTQModel, pinned)")
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(home() / "venv")
    cmd = [str(py), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           "-q", *PINNED]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MemspecError(f"installing GPTQModel took over {timeout:.0f} s",
                           f"rerun `{COMMAND} --timeout {2 * timeout:.0f}`") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise MemspecError(f"pip could not install GPTQModel into the side environment "
                           f"({last[:200]})", "check that PyPI is reachable, then rerun "
                           f"`{COMMAND}`")
    stamp.write_text("\n".join(PINNED))
    return py


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _draft_source(work: Path, target: Path) -> tuple[Path, object]:
    """The small draft without memspec's own tensors and with the target's tokenizer files
    (GPTQModel loads plain HF folders with a tokenizer; calibration comes as draft ids);
    returns the folder and its id map."""
    import torch
    from safetensors.torch import load_file, save_file

    src = work / "draft-src"
    sd = load_file(DRAFT / "model.safetensors")
    id_map = sd.pop("memspec.draft_to_target")
    if not (src / "model.safetensors").is_file():
        src.mkdir(parents=True, exist_ok=True)
        shutil.copy(DRAFT / "config.json", src / "config.json")
        for f in TOKENIZER_FILES:
            if (target / f).is_file():
                shutil.copy(target / f, src / f)
        save_file({k: v.to(torch.float16) for k, v in sd.items()}, str(src / "model.safetensors"),
                  metadata={"format": "pt"})
    return src, id_map


def _target_source(work: Path, target: Path) -> Path:
    """The target as GPTQModel loads it: a plain fp32 HF folder. The converted demo target
    keeps its GGUF blocks as they are (uint8 rows that transformers cannot load); their
    dequantised weights are the fp32 checkpoint such a folder held before."""
    from safetensors.torch import save_file

    from memspec.procs.decoder.forward.checkpoint import load_state_dict
    from memspec.procs.decoder.forward.ggml import is_block_folder

    if not is_block_folder(target):
        return target
    src = work / "target-src"
    if not (src / "model.safetensors").is_file():
        src.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "generation_config.json", *TOKENIZER_FILES):
            if (target / f).is_file():
                shutil.copy(target / f, src / f)
        save_file({k: v.contiguous() for k, v in load_state_dict(target).items()},
                  str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def _calibration(tokenizer, to_draft=None, n: int = 24) -> list[list[int]]:
    from memspec.zoo.prompts import load_prompts

    rows = load_prompts("train", ("general", "code", "math", "law", "medical"), per_domain=5)
    out = []
    for r in rows[:n]:
        ids = tokenizer(r["prompt"])["input_ids"][:128]
        out.append([int(to_draft[i]) for i in ids] if to_draft is not None else ids)
    return out


def _finish_draft(out: Path, id_map) -> None:
    """Put memspec's id map and tokenizer fingerprint back into the quantised draft, and
    take the borrowed tokenizer out (the draft's vocabulary is its id map's)."""
    for f in TOKENIZER_FILES:
        (out / f).unlink(missing_ok=True)
    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    sd = load_file(f)
    if "memspec.draft_to_target" not in sd:
        sd["memspec.draft_to_target"] = id_map
        save_file(sd, str(f), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    fp = json.loads((DRAFT / "config.json").read_text())["memspec_tokenizer_sha256"]
    if cfg.get("memspec_tokenizer_sha256") != fp:
        cfg["memspec_tokenizer_sha256"] = fp
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _run_worker(cmd: list[str], env: dict, log: Path, timeout: float, name: str) -> str:
    """One worker, its output in ``log``, a progress line every 30 s; returns the error
    to report if it leaves no status (its last line, or the timeout)."""
    t0 = time.perf_counter()
    with log.open("w") as out:  # cwd: GPTQModel writes its logs/ under the working directory
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=log.parent)
        try:
            while True:
                try:
                    proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    spent = time.perf_counter() - t0
                    if spent > timeout:
                        proc.kill()
                        proc.wait()
                        return f"timed out after {timeout:.0f} s (log: {log})"
                    _log(f"{name}: {spent:.0f} s")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return f"{(lines or ['?'])[-1].strip()[:300]} (exit {proc.returncode}; log: {log})"


def build(only: list[str] | None = None, timeout: float = 900.0) -> dict:
    """Make every job's folder and reference that is missing; returns status.json."""
    from memspec.procs.decoder.models import encode_prompt, load_tokenizer
    from memspec.procs.decoder.slots import draft_index

    target = default_target_dir()
    if not (target / "config.json").is_file():
        raise MemspecError(f"the demo target is not converted ({target})",
                           "run `memspec zoo target` first")
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    py = ensure_venv(min(timeout, 300.0))
    tok = load_tokenizer(target)
    probe = encode_prompt(tok, PROBE_PROMPT)
    draft_src, id_map = _draft_source(root / "work", target)
    to_draft = draft_index(id_map.long(), tok.vocab_size if hasattr(tok, "vocab_size") else None)
    todo = []
    for name, job in jobs().items():
        if only and name not in only:
            continue
        out, ref = root / name, root / f"{name}.reference.safetensors"
        if (out / "config.json").is_file() and ref.is_file():
            continue
        is_draft = job["src"] == "draft"
        todo.append({**job, "name": name, "out": str(out), "reference": str(ref),
                     "src": str(draft_src if is_draft else _target_source(root / "work",
                                                                          target)),
                     "calibration": _calibration(tok, to_draft if is_draft else None)})
    status_file = root / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    if todo:
        spec = root / "work" / "jobs.json"
        probe_for = {j["name"]: probe for j in todo}
        for j in todo:
            if j["src"] == str(draft_src):
                probe_for[j["name"]] = [int(to_draft[i]) for i in probe]
        run_status = root / "work" / "run-status.json"
        for j in todo:  # one process per job: a draft's probe is in its own vocabulary
            if j["src"] == str(draft_src) and (Path(j["out"]) / "config.json").is_file():
                for f in TOKENIZER_FILES:  # GPTQModel reloads the folder with a tokenizer
                    if (target / f).is_file():
                        shutil.copy(target / f, Path(j["out"]) / f)
            spec.write_text(json.dumps({"jobs": [j], "probe": probe_for[j["name"]],
                                        "status": str(run_status)}))
            _log(f"{j['name']}: GPTQModel quantises {Path(j['src']).name} ({j['method']})")
            env = {**os.environ, "GPTQMODEL_CPU_WORKERS": str(max(2, os.cpu_count() or 1)),
                   "PYTHONWARNINGS": "ignore"}
            left = max(60.0, timeout - (time.perf_counter() - t0))
            log = root / "work" / f"{j['name']}.log"
            error = _run_worker([str(py), str(Path(__file__).with_name("quantref_worker.py")),
                                 str(spec)], env, log, left, j["name"])
            got = json.loads(run_status.read_text()) if run_status.is_file() else {}
            status[j["name"]] = got.get(j["name"], {"ok": False, "error": error})
            if status[j["name"]]["ok"] and j["src"] == str(draft_src):
                _finish_draft(Path(j["out"]), id_map)
            run_status.unlink(missing_ok=True)
            _log(f"{j['name']}: {status[j['name']]}")
    shutil.rmtree(root / "work" / "target-src", ignore_errors=True)  # (538 MB, made again
    status.pop("_error", None)  # only while a target job runs)
    status["_meta"] = {"pinned": list(PINNED), "command": COMMAND, "probe": probe,
                       "seconds": round(time.perf_counter() - t0, 1)}
    status_file.write_text(json.dumps(status, indent=1))
    return status


def failure(status: dict, names: list[str] | None = None) -> str | None:
    """Why the checkpoints (all jobs, or ``names``) are not all there, in one line (None
    when they are)."""
    if "_error" in status:
        return status["_error"]
    bad = [f"{k}: {v.get('error', '?')}" for k, v in status.items()
           if not k.startswith("_") and not v.get("ok")]
    missing = [k for k in (names or jobs()) if k not in status]
    if missing:
        bad.append(f"not made: {', '.join(missing)} (run `{COMMAND}`)")
    return "; ".join(bad) or None


def _record(error: str) -> None:
    """Keep why the side environment could not be made, for the tests' skip reason."""
    f = home() / "status.json"
    try:
        status = json.loads(f.read_text()) if f.is_file() else {}
        status["_error"] = error
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(status, indent=1))
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Progress and detail on stderr; one line on stdout: what was made, or why not."""
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated job names "
                    f"({', '.join(jobs())})")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for everything")
    args = ap.parse_args(argv)
    try:
        status = build(args.only.split(",") if args.only else None, args.timeout)
    except Exception as exc:  # noqa: BLE001 - one line for set-up and the tests' skip
        reason = str(exc) if isinstance(exc, MemspecError) else f"{type(exc).__name__}: {exc}"
        reason = " ".join(reason.split())[:400]
        _record(reason)
        print(f"GPTQModel checkpoints not made: {reason}")
        return 2
    for k, v in status.items():
        if not k.startswith("_"):
            _log(f"{k}: {'ok' if v.get('ok') else 'FAILED: ' + v.get('error', '?')}")
    names = args.only.split(",") if args.only else list(jobs())
    why = failure({k: v for k, v in status.items() if k in names or k.startswith("_")}, names)
    if why:
        print(f"GPTQModel checkpoints not all made ({home()}): {why}")
        return 1
    print(f"GPTQModel checkpoints in {home()} ({status['_meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
