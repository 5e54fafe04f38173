"""The CLI end to end on tiny models: success, and every bad input -> one line, exit 2, no output."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfold.calib.artifact import CalibStats
from kvfold.cli import app

runner = CliRunner()
LLAMA = "LlamaForCausalLM"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, pattern: str, out: Path | None = None):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and pattern in lines[0], lines[0]
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_calibrate_then_inspect(tiny_dirs, tmp_path):
    out = tmp_path / "calib"
    result = run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 200, "--seq-len", 32, "--batch", 2)
    assert result.exit_code == 0, result.output
    stats = CalibStats.load(out)
    h = stats.header
    assert h.tokens == 200 and h.options.source == "random" and h.model.architecture == LLAMA
    assert len(h.model.weights_sha256) == 64 and h.model.num_kv_heads == 2
    assert set(stats.grams) == {f"layers.{i}.{k}" for i in range(2) for k in ("q", "k", "v", "o", "k_mean")}
    assert stats.gram(0, "k").shape == (2, 16, 16) and stats.gram(0, "q").shape == (4, 16, 16)
    header = json.loads((out / "calib.json").read_text())
    assert header["schema_version"] == "1.1" and header["torch_version"] and header["transformers_version"]
    shown = run("inspect", out)
    assert shown.exit_code == 0 and "K (post-RoPE)" in shown.stdout and "mean" in shown.stdout


def test_text_source_prune_and_kmeans(tiny_dirs, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"document {i} " + "words " * 20 for i in range(40)))
    out = tmp_path / "c"
    result = run("calibrate", tiny_dirs[LLAMA], "-o", out, "--text", text, "--tokens", 512,
                 "--seq-len", 16, "--prune", 0.25, "--kmeans", 8, "--seed", 3)
    assert result.exit_code == 0, result.output
    h = CalibStats.load(out).header
    assert h.options.source == "text" and h.options.kmeans == 8 and h.tokens < 512


def test_force_replaces_existing_output(tiny_dirs, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "old").write_text("x")
    result = run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 32, "--force")
    assert result.exit_code == 0 and not (out / "old").exists() and (out / "calib.json").exists()


@pytest.fixture
def unsupported_model(tmp_path):
    d = tmp_path / "foo"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def _no_tokenizer(tiny_dirs, tmp_path) -> Path:
    model = tmp_path / "notok"
    shutil.copytree(tiny_dirs[LLAMA], model, ignore=shutil.ignore_patterns("tokenizer*"))
    return model


def _empty_text(tmp_path) -> Path:
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    return tmp_path / "empty.txt"


# case -> (the model given: a function of (tiny_dirs, tmp_path, unsupported_model), extra flags: a function of
# tmp_path, the expected message). The output folder is tmp_path / "calib"; "exists" makes it first.
_LLAMA_DIR = lambda dirs, tmp, foo: dirs[LLAMA]  # noqa: E731
BAD_CALIBRATE = {
    "missing": (lambda dirs, tmp, foo: tmp / "nope", lambda tmp: [], "does not exist"),
    "not_a_model": (lambda dirs, tmp, foo: tmp, lambda tmp: [], "not a HF model folder"),
    "unsupported": (lambda dirs, tmp, foo: foo, lambda tmp: [], "unsupported architecture 'FooForCausalLM'"),
    "tokens0": (_LLAMA_DIR, lambda tmp: ["--tokens", 0], "--tokens must be at least 1"),
    "empty_text": (_LLAMA_DIR, lambda tmp: ["--text", _empty_text(tmp)], "is empty"),
    "missing_text": (_LLAMA_DIR, lambda tmp: ["--text", tmp / "none.txt"], "text file"),
    "exists": (_LLAMA_DIR, lambda tmp: [], "already exists; pass --force"),
    "bad_prune": (_LLAMA_DIR, lambda tmp: ["--prune", 1.0], "--prune must be in [0, 1)"),
    "bad_dtype": (_LLAMA_DIR, lambda tmp: ["--dtype", "float8"], "--dtype must be one of"),
    "text_with_random": (_LLAMA_DIR, lambda tmp: ["--source", "random", "--text", "wiki:calib"],
                         "--text is only used with --source text"),
    "kmeans_too_big": (_LLAMA_DIR, lambda tmp: ["--kmeans", 100000, "--tokens", 64], "--kmeans 100000 exceeds"),
    "no_tokenizer": (lambda dirs, tmp, foo: _no_tokenizer(dirs, tmp), lambda tmp: ["--source", "text"],
                     "has no usable tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD_CALIBRATE))
def test_bad_input_one_line_exit_2_no_output(case, tiny_dirs, tmp_path, unsupported_model):
    model_of, extra_of, pattern = BAD_CALIBRATE[case]
    out = tmp_path / "calib"
    if case == "exists":
        out.mkdir()
    result = run("calibrate", model_of(tiny_dirs, tmp_path, unsupported_model), "-o", out, *extra_of(tmp_path))
    assert_user_error(result, pattern, None if case == "exists" else out)
    if case == "exists":
        assert list(out.iterdir()) == []


def test_inspect_rejects_a_non_calibration_dir(tmp_path):
    assert_user_error(run("inspect", tmp_path), "not a calibration directory")


def test_corrupted_stats_are_detected(tiny_dirs, tmp_path):
    out = tmp_path / "c"
    assert run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 32).exit_code == 0
    stats = out / "stats.safetensors"
    data = bytearray(stats.read_bytes())
    data[-1] ^= 0xFF
    stats.write_bytes(bytes(data))
    assert_user_error(run("inspect", out), "corrupted")


@pytest.mark.parametrize("command", ["calibrate", "export"])
def test_ctrl_c_mid_run_leaves_nothing(command, tiny_dirs, tmp_path):
    out = tmp_path / "out"
    model = str(tiny_dirs[LLAMA])
    if command == "calibrate":
        args = ["calibrate", model, "-o", str(out), "--tokens", "50000000", "--seq-len", "64"]
    else:
        calib = tmp_path / "c"
        assert run("calibrate", model, "-o", calib, "--tokens", 256, "--seq-len", 64).exit_code == 0
        text = tmp_path / "long.txt"
        text.write_text("\n\n".join("some words of text " * 40 for _ in range(4000)))  # ~3M byte tokens
        args = ["export", model, "--calib", str(calib), "--accuracy", "0.99", "--eval-text", str(text),
                "--eval-tokens", "3000000", "-o", str(out)]
    # A shell started in the background (`cmd &`, nohup) ignores SIGINT and children inherit that; a user at
    # a terminal has the default disposition, so give the child that, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-m", "kvfold", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.tmp-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(2.0)  # well inside the run
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()  # never leave a 50M-token run behind when the test fails
    assert proc.returncode == 2, stderr
    # Export prints a plain line per stage when stderr is not a terminal (issue 12); the interruption must end
    # the run with exactly one error line after them, and no traceback.
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines[-1] == "error: interrupted; no output was written", stderr
    assert all(ln.startswith(f"{command} [") for ln in lines[:-1]), stderr
    assert "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))
