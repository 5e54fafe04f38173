"""`kvfold-bench`, a console script of its own: the product's `kvfold` has no bench command, and every bench
command that takes a path or a number turns bad input into one `error:` line, exit 2, before any work."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from typer.testing import CliRunner

from kvfold import cli
from kvfold_bench.cli import app
from tests.runtime.conftest import write_export
from tests.test_cli import assert_user_error

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_bench_is_its_own_console_script_not_a_kvfold_command():
    (script,) = entry_points(group="console_scripts", name="kvfold-bench")
    assert script.value == "kvfold_bench.cli:main"
    assert runner.invoke(cli.app, ["bench", "--help"]).exit_code == 2  # no such command
    done = subprocess.run([sys.executable, "-m", "kvfold_bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and all(c in done.stdout for c in ("frontier", "calibrate", "memory", "compile"))


@pytest.mark.parametrize("args, message", [
    (["calibrate", "--tokens", "0"], "--tokens must be at least 1"),
    (["calibrate", "--tokens", "1024", "--tokens", "-5"], "--tokens must be at least 1"),
    (["calibrate", "--seq-len", "0"], "--seq-len must be at least 1"),
    (["calibrate", "--batch", "0"], "--batch must be at least 1"),
    (["calibrate", "--source", "nope"], "--source must be one of random, text"),
    (["calibrate", "--model", "{tmp}/missing"], "does not exist"),
    (["export", "--model", "{tmp}/missing"], "does not exist"),
    (["export", "--accuracy", "2"], "--accuracy"),
    (["export", "--calib-tokens", "0"], "--calib-tokens must be at least 1"),
    (["export", "--heldout-tokens", "0"], "--heldout-tokens must be at least 1"),
    (["memory", "--export", "{tmp}/missing"], "is not a kvfold export"),
    (["memory", "--export", "{tmp}"], "is not a kvfold export"),
    (["memory", "--export", "{tmp}", "--context", "0"], "--context must be at least 1"),
    (["memory", "--export", "{tmp}", "--new-tokens", "0"], "--new-tokens must be at least 1"),
    (["memory", "--export", "{tmp}", "--batch", "-1"], "--batch must be at least 1"),
    (["kernels", "--reps", "0"], "--reps must be at least 1"),
    (["openai", "--export", "{tmp}", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["ttft", "--export", "{tmp}", "--dtype", "int8"], "--dtype must be auto, float32"),
    (["ruler", "--export", "{tmp}", "--dtype", "fp8"], "--dtype must be auto, float32"),
    (["ruler", "--export", "{tmp}", "--only", "both"], "--only must be original or export"),
    (["compile", "--tokens", "0"], "--tokens must be at least 1"),
    (["compile", "--dtype", "int8"], "--dtype must be one of"),
    (["compile", "--verify-dtype", "int8"], "--verify-dtype must be one of"),
    (["compile", "--shape", "tiny-llama", "--device", "tpu"], "--device must be one of"),
    (["calibrate-point", "{tmp}/missing"], "does not exist"),  # the hidden per-process commands too
    (["memory-point", "{tmp}/missing"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    assert_user_error(run(*(a.format(tmp=tmp_path) for a in args)), message)


def test_memory_refuses_a_missing_original_before_any_run(tiny_dirs, tmp_path):
    export = write_export("LlamaForCausalLM", tiny_dirs["LlamaForCausalLM"], tmp_path / "export")
    assert_user_error(run("memory", "--export", export.path, "--against", tmp_path / "missing"), "does not exist")


def test_kernels_refuses_a_folder_that_is_not_an_export(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --smoke on a CPU; nothing runs: the --export check comes first
    assert_user_error(run("kernels", "--smoke", "--export", tmp_path), "is not a kvfold export")
    assert_user_error(run("kernels", "--smoke", "--dtype", "int8"), "--dtype int8")
