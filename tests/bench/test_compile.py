"""`kvfold-bench compile` end to end on the two-layer shape: every stage is the real command in its own
process, and the JSON carries what each one took."""

import json

import pytest
import torch

from tests.bench.test_cli import run
from tests.test_cli import assert_user_error


def test_compile_times_every_stage(tmp_path):
    out = tmp_path / "compile.json"
    # 2 GiB held (and touched) by this process while it forks the stages: a stage's peak RSS must be its own
    # (ru_maxrss of a child starts at its parent's RSS at fork: on a GPU the parent holds the 8B model it wrote)
    held = torch.ones(2**29)
    result = run("compile", "--shape", "tiny-llama", "--tokens", 1024, "--dtype", "float32",
                 "--device", "cpu", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [s["stage"] for s in report["stages"]] == ["calibrate", "export", "verify"]
    assert all(s["rc"] == 0 and s["wall_s"] > 0 and 100 < s["peak_rss_mib"] < 1800 for s in report["stages"])
    del held
    assert report["total_s"] >= sum(s["wall_s"] for s in report["stages"]) - 0.2
    # random weights: a target every candidate meets, so the search walks its whole path (10 candidates; on this
    # model's 16-dim heads, rounded to 8, fewer distinct rank sets, each scored once)
    assert 2 <= report["export"]["candidates_scored"] <= 10 and report["random_weights"]
    assert report["verify"]["meaningful"] is False and report["cuda_peak_mib"] is None
    # issue 52: the model's bytes, each stage's activations measured apart, and the bound on its peak RSS
    act = report["activations_mib"]
    assert report["model_mib"] > 0 and act["loaded_rss_mib"] > 100 and all(
        act[f"{p}_mib"] >= 0 for p in ("calibrate", "score", "passkey"))
    for s in report["stages"]:
        assert s["rss_bound_mib"] == pytest.approx(1.3 * report["model_mib"] + s["activations_mib"], abs=0.2)
        assert s["within_bound"] == (s["peak_rss_mib"] <= s["rss_bound_mib"])


def test_unknown_shape_and_an_8b_shape_on_the_cpu_are_one_line():
    assert_user_error(run("compile", "--shape", "gpt5"), "--shape must be one of")
    assert_user_error(run("compile", "--shape", "llama3-8b", "--device", "cpu"), "is a GPU benchmark")
