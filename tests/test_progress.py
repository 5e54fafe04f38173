"""Long stages show their progress (kvfold/progress.py): a rich bar with its ETA on a terminal, plain timed lines
without one; the library alone prints nothing."""

import io
import logging
import os
import re
import select
import subprocess
import sys
import time

import pytest
from rich.console import Console

from kvfold.progress import progress, shown_on
from tests.conftest import save_tiny, write_tiny_text
from tests.test_cli import run

LLAMA = "LlamaForCausalLM"
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-B]|[=>78])")
BARS = "━╸╺"


@pytest.fixture(scope="module")
def passkey_export(tmp_path_factory):
    """The CLI's export command on the tiny Llama given a 1,024-token context, where the pass keys really run."""
    root = tmp_path_factory.mktemp("progress")
    model = save_tiny(root / "model", LLAMA, max_position_embeddings=1024)
    text = write_tiny_text(root / "eval.txt")
    assert run("calibrate", model, "-o", root / "calib", "--tokens", 512, "--seq-len", 64).exit_code == 0

    def command(out: str) -> list[str]:
        return [sys.executable, "-m", "kvfold", "export", str(model), "--calib", str(root / "calib"), "--eval-text",
                str(text), "--eval-tokens", "256", "--margin", "0", "--accuracy", "0.8", "--passkey", "512",
                "--device", "cpu", "-o", str(root / out)]

    return command


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "FORCE_TERMINAL", "TTY_COMPATIBLE", "NO_COLOR", "KVFOLD_PROGRESS_SECONDS")}
    return {**env, **extra}


def _under_a_terminal(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run `argv` with stdin, stdout and stderr on a pseudo-terminal; its exit code and every byte it wrote."""
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env=_env(TERM="xterm", COLUMNS="160", LINES="40"))
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


def test_a_terminal_shows_a_bar_for_the_pass_keys(passkey_export):
    code, raw = _under_a_terminal(passkey_export("tty"))
    text = ANSI.sub("", raw).replace("\r", "\n")
    assert code == 0, text[-3000:]
    assert "\x1b[" in raw  # drawn as a terminal's bar, not plain lines
    bars = [ln for ln in text.splitlines() if "pass keys at p=" in ln and any(c in ln for c in BARS)]
    assert bars, text[-3000:]
    assert any(re.search(r"\d+%.*\d+/\d+ prompts.*ETA", ln) for ln in bars), bars
    assert not re.search(r"pass keys at p=\S+: \d+/\d+ prompts", text)  # no plain lines on a terminal


def test_without_a_terminal_plain_timed_lines(passkey_export):
    got = subprocess.run(passkey_export("pipe"), capture_output=True, text=True, timeout=300,
                         env=_env(KVFOLD_PROGRESS_SECONDS="0"))
    assert got.returncode == 0, got.stderr[-3000:]
    assert re.search(r"^pass keys at p=\S+: \d+/\d+ prompts, \d+ s, ~\d+ s left$", got.stderr, re.M), got.stderr
    assert re.search(r"^pass keys at p=\S+: (\d+)/\1 prompts in \d+ s$", got.stderr, re.M), got.stderr
    assert "\x1b" not in got.stderr and not any(c in got.stderr for c in BARS)


def test_plain_lines_wait_for_the_interval_and_the_library_alone_prints_nothing(monkeypatch, caplog):
    monkeypatch.setenv("KVFOLD_PROGRESS_SECONDS", "3600")
    sink = io.StringIO()
    with shown_on(Console(file=sink, width=200)), progress("short", 4, "steps") as advance:
        for _ in range(4):
            advance()
    assert sink.getvalue() == ""  # a stage shorter than the interval says nothing
    monkeypatch.setenv("KVFOLD_PROGRESS_SECONDS", "0")
    with caplog.at_level(logging.INFO, logger="kvfold"), progress("probes", 2, "probes") as advance:
        advance()
        advance()
    said = [r.getMessage() for r in caplog.records if r.name == "kvfold"]  # shown only where logging is configured
    assert len(said) == 2, said
    assert re.fullmatch(r"probes: 1/2 probes, \d+ s, ~\d+ s left", said[0]), said
    assert re.fullmatch(r"probes: 2/2 probes in \d+ s", said[1]), said
