"""`kvfold-bench kernels`: its widths, its refusal without a GPU, and a smoke run end to end (the Triton
kernels in the interpreter on CPU: the command and its JSON/PNG, not its timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvfold_bench.kernels import bits_layer, synthetic_layer
from tests.bench.test_cli import run
from tests.runtime.conftest import write_export
from tests.test_cli import assert_user_error


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_synthetic_layers_keep_one_minus_p_uniform_or_uneven(p):
    for uneven in (False, True):
        layer = synthetic_layer(p, uneven, num_heads=32, num_kv_heads=8, head_dim=128)
        assert layer.p == pytest.approx(p, abs=1e-3) and layer.flop_ratio == pytest.approx(1 - p, abs=1e-3)
        assert all(1 <= w <= 128 for w in layer.d_k + layer.d_v) and layer.group == 4
        assert (len(set(layer.d_k)) > 1) == uneven and (layer.d_k != layer.d_v) == uneven


def test_a_bits_layer_counts_its_band_bytes_against_16_bit_numbers():
    layer = bits_layer("b", [(8, 16), (4, 112)], [(4, 128)], num_heads=32, num_kv_heads=8, head_dim=128)
    keys, values = 16 + 56 + 2, 64 + 1  # codes, then one log8 scale byte per band
    assert layer.dims.row_bytes() == (8 * keys, 8 * values)
    assert layer.p == pytest.approx(1 - (keys + values) / (2 * 128 * 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    assert_user_error(run("kernels", "--json", tmp_path / "k.json"), "has no CUDA device",
                      tmp_path / "k.json")
    assert_user_error(run("kernels", "--json", tmp_path / "no" / "k.json"), "does not exist")
    assert_user_error(run("kernels", "--smoke", "--graphs", "--json", tmp_path / "g.json"), "--graphs replays",
                      tmp_path / "g.json")


def test_a_smoke_run_writes_json_and_png(tiny_dirs, tmp_path):
    export = write_export("LlamaForCausalLM", tiny_dirs["LlamaForCausalLM"], tmp_path / "export", "uneven")
    out, png = tmp_path / "k.json", tmp_path / "k.png"
    done = subprocess.run([sys.executable, "-m", "kvfold_bench", "kernels", "--smoke", "--reps", "1",
                           "--export", str(export.path), "--json", str(out), "--png", str(png)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert png.stat().st_size > 10_000 and report["smoke"] and len(report["layers"]) == 7
    first = report["layers"][0]  # the export's median layer
    assert first["d_k"] == export.manifest.d_k[int(first["name"].rsplit(" ", 1)[-1])]
    decode = [r for r in report["rows"] if r["kind"] == "decode"]
    bits = [r for r in report["rows"] if r["layer"].startswith("bits")]
    assert len(decode) == 7 and all(r["kvfold_triton_us"] > 0 and r["kvfold_triton_balanced_ratio"] > 0
                                    for r in decode if r not in bits)
    assert len(bits) == 4 and all(r["kvfold_triton_bits_us"] > 0 for r in bits)  # decode and prefill, 2 layers
    # both bits layers have 16-dim bands: their decode also runs over the GPU page layout
    assert all(r["kvfold_triton_pages_us"] > 0 for r in bits if r["kind"] == "decode")
    assert all(r["kvfold_triton_pages_window_us"] > 0 for r in bits if r["kind"] == "decode")
    assert all(r["kvfold_triton_pages_step_us"] > 0 for r in bits if r["kind"] == "decode")
    assert {r["kind"] for r in report["rows"]} == {"decode", "prefill"}
