"""The engine host forks `python -m MODULE ARGS` as a fresh process would run it: output, exit status,
environment, working directory, and nothing of it left running after it ends (no vLLM here: nothing preloaded)."""

import os
import signal
import subprocess
import threading
import time

import pytest

from kvfold_bench.engine_host import _host, run_module

CHILD = "tests.bench.engine_host_child"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, timeout: float | None = 60, **env) -> subprocess.CompletedProcess:
    return run_module(CHILD, list(args), env={**os.environ, **env}, cwd=REPO, timeout=timeout, preload=())


def test_the_child_sees_its_argv_env_and_cwd_and_its_output_is_captured():
    done = _run("exit", "0", KVFOLD_PROBE="seen")
    assert done.returncode == 0
    assert done.stdout.strip() == f"argv=['exit', '0'] cwd={REPO} probe=seen" and done.stderr.strip() == "to stderr"
    assert "probe=None" in _run("exit", "0").stdout  # the environment is the request's, not the last child's


def test_exit_codes_and_exceptions_are_reported_as_a_fresh_process_would():
    assert _run("exit", "3").returncode == 3
    raised = _run("raise")
    assert raised.returncode == 1 and raised.stderr.strip().endswith("ValueError: raised in the child")


def test_processes_the_child_started_do_not_outlive_it():
    done = _run("orphan")
    pid = int(done.stdout.splitlines()[-1])
    time.sleep(0.5)
    assert not _running(pid)  # killed with the child's session


def test_a_host_stopped_mid_run_takes_the_run_with_it(tmp_path):
    pidfile, raised = tmp_path / "pid", []

    def run() -> None:
        try:
            _run("hang", str(pidfile), timeout=60)
        except RuntimeError as e:  # the host exited before it answered
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(300):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    _host(()).proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert raised and "engine host exited" in str(raised[0])
    time.sleep(0.5)
    assert not _running(int(pidfile.read_text()))
    assert _run("exit", "0").returncode == 0  # a new host serves the next run


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whatever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_past_its_timeout_is_killed_and_raises_as_subprocess_run_does():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run("hang", timeout=1)
    assert time.monotonic() - start < 30
    assert _run("exit", "0").returncode == 0  # the host serves the next run
