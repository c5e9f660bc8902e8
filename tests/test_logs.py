"""Log lines with timestamp, level and process (common/logs.py), and how the supervisor's
children set themselves up without `preexec_fn` (common/child.py): they die with the
supervisor, take their niceness and the log level from the environment."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from memspec.common import child, logs
from memspec.common.errors import ConfigError
from memspec.launch import supervisor as sup_mod
from memspec.launch.supervisor import Supervisor

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d "
                  r"(DEBUG|INFO|WARNING|ERROR) (\w+)\[(\d+)\]: (.*)$")


@pytest.fixture
def logged(capsys):
    yield capsys
    logs.reset()


def test_lines_carry_time_level_process_and_pid_and_respect_the_level(logged, monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    logs.setup("decoder", "warning")
    log = logging.getLogger("memspec.procs.decoder.service")
    log.info("not shown")
    log.warning("slot %d quarantined", 3)
    lines = logged.readouterr().err.splitlines()
    assert len(lines) == 1
    m = LINE.match(lines[0])
    assert m and m.groups()[1:] == ("decoder", str(os.getpid()), "slot 3 quarantined")
    assert m.group(1) == "WARNING" and logs.message_of(lines[0]) == "slot 3 quarantined"
    logging.getLogger("other.library").warning("not ours")  # no handler of ours above it
    assert "not ours" not in logged.readouterr().err
    monkeypatch.setenv(logs.LEVEL_ENV, "debug")
    logs.setup("loader")  # again: one handler, the new process name and level
    log.debug("now shown")
    lines = logged.readouterr().err.splitlines()
    assert len(lines) == 1 and LINE.match(lines[0]).group(2) == "loader"


def test_an_unknown_level_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(logs.LEVEL_ENV, "verbose")
    with pytest.raises(ConfigError, match="unknown log level 'verbose'; use one of: debug"):
        logs.level_name()
    res = subprocess.run([sys.executable, "-m", "memspec", "up", "--no-stdin"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, MEMSPEC_LOG_LEVEL="verbose"))
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["memspec: error: unknown log level 'verbose'; use one "
                                       "of: debug, info, warning, error"]


def test_children_are_spawned_without_preexec_fn_and_told_what_to_apply(tmp_path, monkeypatch):
    seen: dict[str, dict] = {}

    class FakePopen:
        def __init__(self, cmd, **kw):
            seen[cmd[2].split(".")[2]] = kw
            self.pid = 1

        def poll(self):
            return None

    reniced: list[int] = []
    monkeypatch.setattr(sup_mod.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(sup_mod, "renice", lambda pid, inc: reniced.append(inc))
    (tmp_path / "run").mkdir()
    sup = Supervisor(run_dir=tmp_path / "run", log_level="debug")
    try:
        for name in ("decoder", "loader", "predictor"):
            sup.spawn(name)
    finally:
        for p in sup.procs.values():
            p.popen = None
        sup.shutdown()
    assert set(seen) == {"decoder", "loader", "predictor"}
    for name, kw in seen.items():
        assert "preexec_fn" not in kw and kw["start_new_session"]
        env = kw["env"]
        assert env[child.PARENT_ENV] == str(os.getpid()) and env[logs.LEVEL_ENV] == "debug"
        assert env[child.NICE_ENV] == ("0" if name == "decoder" else str(sup_mod.HELPER_NICE))
        # the decoder alone: its numpy starts no spinning BLAS thread, its block is sized
        assert ("OPENBLAS_NUM_THREADS" in env) == (name == "decoder")
        assert ("MEMSPEC_ARENA" in env) == (name == "decoder")
    assert reniced == [sup_mod.HELPER_NICE] * 2  # each helper from its first instruction


@pytest.mark.parametrize("policy, reads", [("memspec", False), ("oracle-static", True),
                                           ("", True)])  # "": the pool's, maybe an oracle
def test_a_private_run_reads_the_oracle_tables_only_for_an_oracle_request(policy, reads,
                                                                           monkeypatch):
    from memspec.launch import up

    made: list[Supervisor] = []

    class Stop(Exception):
        pass

    def fake(*args, **kw):
        made.append(Supervisor(*args, **kw))
        raise Stop

    monkeypatch.setattr(up, "Supervisor", fake)
    with pytest.raises(Stop):
        up.generate(None, "hi", stream=False, fresh=True, policy=policy, max_new_tokens=4)
    assert ("--no-oracle-tables" not in made[0]._cmd("decoder", "t")) is reads


def test_a_helper_reniced_at_spawn_does_not_take_its_niceness_twice():
    code = ("import os, time; from memspec.common import child; "
            "time.sleep(0.5); child.start('loader'); print(os.nice(0))")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, **{child.NICE_ENV: "5",
                                                 child.PARENT_ENV: str(os.getpid())}))
    child.renice(p.pid, 5)
    assert int(p.communicate(timeout=60)[0]) == min(19, os.nice(0) + 5)


def _python(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, **env),
                            stdout=subprocess.PIPE, text=True)


def test_a_child_takes_its_niceness_and_exits_when_its_parent_is_already_gone():
    code = ("import os; from memspec.common import child; before = os.nice(0); "
            "child.start('loader'); print(os.nice(0) - before)")
    p = _python(code, **{child.NICE_ENV: "7"})
    assert p.communicate(timeout=60)[0].strip() == "7"
    p = _python(code, **{child.PARENT_ENV: "1"})  # not its parent: it was orphaned at start
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out == ""


def test_a_child_dies_with_its_parent():
    """The parent is SIGKILLed (no cleanup of its own): the kernel SIGTERMs the child."""
    grandchild = ("from memspec.common import child; child.start('predictor'); "
                  "import time; print('up', flush=True); time.sleep(60)")
    parent = (f"import os, subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
              f"env=dict(os.environ, {child.PARENT_ENV}=str(os.getpid()))); "
              f"print(p.pid, flush=True); time.sleep(60)")
    mid = _python(parent)
    pid = int(mid.stdout.readline())
    time.sleep(1.0)  # the grandchild has started (and asked for its parent-death signal)
    os.kill(mid.pid, signal.SIGKILL)
    mid.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init once it exits; a zombie counts as gone too
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the child outlived its parent")
