"""--device-map auto (accelerate) on the CPU: a memory cap (KVFOLD_MAX_MEMORY, accelerate's max_memory) small
enough that the tiny Llama's second layer and head are offloaded to the disk; calibrate, export and verify give the
uncapped run's results — kvfold's attention taps and patches (kvfold/hooks.py) work beside accelerate's hooks."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvfold.calib.artifact import CalibStats
from tests.test_cli import assert_user_error, run

LLAMA = "LlamaForCausalLM"
CAP = "cpu=400KB"  # the embeddings and layer 0 in memory, layer 1, the norm and the head on the disk (~430 KB)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("dm") / "eval.txt"
    path.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    return path


def _compile(model, text, root, *extra):
    calib, out = root / "calib", root / "out"
    result = run("calibrate", model, "-o", calib, "--tokens", 512, "--seq-len", 64, *extra)
    assert result.exit_code == 0, result.output
    result = run("export", model, "--calib", calib, "--eval-text", text, "--eval-tokens", 256, "--accuracy", 0.8,
                 "--margin", 0, "--multiple", 1, "--min-rank", 4, "-o", out, *extra)
    assert result.exit_code == 0, result.output
    done = run("verify", out, "--eval-text", text, "--eval-tokens", 256, "--new-tokens", 8, "--json", *extra)
    assert done.exit_code == 0, done.output
    return calib, out, json.loads(done.stdout)


def test_an_offloaded_model_gives_the_uncapped_results(tiny_dirs, text, tmp_path, monkeypatch, caplog):
    plain = _compile(tiny_dirs[LLAMA], text, tmp_path / "plain")
    monkeypatch.setenv("KVFOLD_MAX_MEMORY", CAP)
    with caplog.at_level(logging.INFO, logger="kvfold.sources.models"):
        capped = _compile(tiny_dirs[LLAMA], text, tmp_path / "capped", "--device-map", "auto")
    placed = [m for m in caplog.messages if m.startswith("--device-map auto:")]
    # calibrate, export's search, verify's two models; each with a layer on the disk
    assert len(placed) == 4 and all("on disk" in m for m in placed), placed
    assert all("model.embed_tokens on cpu" in m for m in placed), placed

    a, b = CalibStats.load(plain[0]), CalibStats.load(capped[0])
    assert a.grams.keys() == b.grams.keys()
    for name in a.grams:
        assert torch.allclose(a.grams[name], b.grams[name], rtol=1e-10, atol=0), name
    ma, mb = (json.loads((o / "kvfold.json").read_text()) for o in (plain[1], capped[1]))
    assert ma["chosen"] == mb["chosen"] and ma["curve"] == mb["curve"]
    assert ma["d_k"] == mb["d_k"] and ma["d_v"] == mb["d_v"]
    weights = {n for n in ma["files"] if n.endswith(".safetensors")}
    assert weights and {n: ma["files"][n] for n in weights} == {n: mb["files"][n] for n in weights}
    ra, rb = plain[2], capped[2]
    assert ra["ok"] and rb["ok"]
    assert ra["texts"] == rb["texts"] and ra["generation"] == rb["generation"]
    assert ra["kv_bytes_ratio"] == rb["kv_bytes_ratio"]


def test_a_cap_without_room_for_the_embeddings_and_a_bad_map_are_one_line(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFOLD_MAX_MEMORY", "cpu=10KB")
    out = tmp_path / "c"
    assert_user_error(run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 64, "--device-map", "auto"),
                      "leaves no room on cpu for the embeddings", out)
    assert_user_error(run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 64, "--device-map", "balanced"),
                      "--device-map must be auto", out)
    monkeypatch.setenv("KVFOLD_MAX_MEMORY", "lots")
    assert_user_error(run("calibrate", tiny_dirs[LLAMA], "-o", out, "--tokens", 64, "--device-map", "auto"),
                      "KVFOLD_MAX_MEMORY='lots' is not like", out)
