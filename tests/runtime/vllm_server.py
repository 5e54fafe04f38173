"""vLLM's OpenAI-compatible server for a test: 127.0.0.1, a free port, bounded waits, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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
    raise AssertionError(f"the vLLM server's process group {proc.pid} did not stop")


@contextlib.contextmanager
def serve(model: Path, start_timeout: float = 420) -> Iterator[str]:
    """Start the server on `model`; yield its base URL once /health answers; stop it."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(64 << 20)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError("the vLLM server exited:\n" + Path(log.name).read_text()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"no /health answer in {start_timeout} s:\n" + Path(log.name).read_text()[-3000:])
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            time.sleep(2)
        yield base
    finally:
        _stop(proc)
        log.close()
        os.unlink(log.name)
