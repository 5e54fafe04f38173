"""run_dtype, the one dtype rule: an explicit --dtype wins; auto runs a half-precision checkpoint in its own dtype on
CUDA and on a CPU with native instructions for it, else in float32 — in every stage, the pass keys included."""

import json
import logging

import pytest
import torch

from kvfold.sources import models
from kvfold.sources.models import resolve_model, run_dtype
from tests.conftest import save_tiny
from tests.test_cli import run

LLAMA = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """The tiny Llama in bfloat16 with a 1,024-token context: room for pass-key prompts of 512 tokens."""
    return save_tiny(tmp_path_factory.mktemp("bf16") / "model", LLAMA, torch.bfloat16, max_position_embeddings=1024)


@pytest.mark.parametrize(("native", "device", "want"), [(True, "cpu", "bfloat16"), (False, "cpu", "float32"),
                                                        (False, "cuda", "bfloat16")])
def test_auto_is_the_models_own_dtype_where_it_runs_natively(bf16_dir, monkeypatch, caplog, native, device, want):
    monkeypatch.setattr(models, "native_half", lambda dtype: native)
    ref = resolve_model(str(bf16_dir))
    with caplog.at_level(logging.INFO, logger="kvfold.sources.models"):
        assert run_dtype(ref, "auto", device) == want  # said at INFO: a choice was made
    assert caplog.messages[-1].startswith(f"dtype: {want}")
    assert run_dtype(ref, "float16", device) == "float16"  # an explicit dtype wins


def test_a_float32_model_runs_in_float32_without_asking_the_cpu(tiny_dirs, monkeypatch):
    monkeypatch.setattr(models, "native_half", lambda dtype: pytest.fail("asked"))
    assert run_dtype(resolve_model(str(tiny_dirs[LLAMA]))) == "float32"


def test_the_probe_measures_once_and_answers_per_dtype():
    models.native_half.cache_clear()
    state = torch.random.get_rng_state()
    answer = models.native_half("bfloat16")
    assert torch.equal(torch.random.get_rng_state(), state)  # asking moves nobody's seed
    assert isinstance(answer, bool) and models.native_half.cache_info().misses == 1
    assert models.native_half("bfloat16") is answer and models.native_half.cache_info().hits == 1


def test_without_native_bfloat16_every_stage_runs_in_float32(bf16_dir, tmp_path, monkeypatch, caplog):
    """A bfloat16 checkpoint on a CPU without native bfloat16: calibrate, the search, the pass-key check and
    verify (both models, its pass keys too) each run float32 weights, and each says so in the log."""
    from transformers import AutoModelForCausalLM

    from kvfold.plan import planner

    monkeypatch.setattr(models, "native_half", lambda dtype: False)
    ran: list[torch.dtype] = []  # the weights' dtype of every forward pass of every model loaded
    original_load = AutoModelForCausalLM.from_pretrained.__func__

    def spied(cls, *args, **kwargs):
        model = original_load(cls, *args, **kwargs)
        weights = next(model.parameters())  # every pass, of whatever part of the model, starts at the embeddings
        model.get_input_embeddings().register_forward_pre_hook(lambda m, _: ran.append(weights.dtype))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spied))
    checked: list[torch.dtype] = []
    keep = planner.keep_passkeys

    def keep_spied(net, *args, **kwargs):
        checked.append(next(net.parameters()).dtype)
        return keep(net, *args, **kwargs)

    monkeypatch.setattr(planner, "keep_passkeys", keep_spied)

    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    calib, out = tmp_path / "calib", tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="kvfold.sources.models"):
        assert run("calibrate", bf16_dir, "-o", calib, "--tokens", 512, "--seq-len", 64).exit_code == 0
        assert ran and set(ran) == {torch.float32}
        stages = {"calibrate": len(ran)}
        result = run("export", bf16_dir, "--calib", calib, "--eval-text", text, "--eval-tokens", 256, "--margin", 0,
                     "--accuracy", 0.8, "--passkey", 512, "-o", out)
        assert result.exit_code == 0, result.output
        stages["export"] = len(ran)
        done = run("verify", out, "--eval-text", text, "--eval-tokens", 256, "--passkey", 512, "--new-tokens", 4,
                   "--json")
        assert done.exit_code in (0, 1), done.output
    assert set(ran) == {torch.float32} and len(ran) > stages["export"] > stages["calibrate"]
    assert checked == [torch.float32]  # the export's pass-key check ran on the float32 model, no second one
    report = json.loads(done.stdout)
    assert "skipped" not in report["passkey"] and report["passkey"]["original"]["prompts"] > 0  # verify's ran
    manifest = json.loads((out / "kvfold.json").read_text())
    assert manifest["search_dtype"] == "float32" and manifest["passkey"] and "skipped" not in manifest["passkey"]
    assert json.loads((calib / "calib.json").read_text())["options"]["dtype"] == "float32"
    said = [m for m in caplog.messages if m.startswith("dtype:")]
    assert len(said) == 3 and all(m.startswith("dtype: float32 (--dtype auto): the model is bfloat16") for m in said)
