"""kvfold export end to end on a tiny model, and its bad inputs."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.io import sha256_file
from kvfold.plan.criteria import Target
from tests.conftest import save_tiny, write_tiny_text
from tests.test_cli import assert_user_error, run

LLAMA = "LlamaForCausalLM"


def export_setup(tiny_dirs, tmp_path_factory) -> tuple:
    """(the tiny Llama's folder, its calibration, an evaluation text, a folder): what the export tests share."""
    root = tmp_path_factory.mktemp("export")
    text = write_tiny_text(root / "eval.txt")
    calib = root / "calib"
    assert run("calibrate", tiny_dirs[LLAMA], "-o", calib, "--tokens", 512, "--seq-len", 64).exit_code == 0
    return tiny_dirs[LLAMA], calib, text, root


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    return export_setup(tiny_dirs, tmp_path_factory)


def _export(setup, out, *extra):
    """One 256-token evaluation window: fast, but no standard error, so no margin."""
    model, calib, text, _ = setup
    return run("export", model, "--calib", calib, "--eval-text", text, "--eval-tokens", 256, "--margin", 0,
               "-o", out, *extra)


def test_the_default_margin_needs_two_windows_and_is_recorded(setup, tmp_path):
    model, calib, text, _ = setup
    args = ("export", model, "--calib", calib, "--eval-text", text, "--accuracy", 0.5)
    assert_user_error(run(*args, "--eval-tokens", 256, "-o", tmp_path / "a"), "raise --eval-tokens to 1024",
                      tmp_path / "a")
    result = run(*args, "--eval-tokens", 1024, "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output
    m = Manifest.load(tmp_path / "b")
    assert m.target == "top-1 ratio ≥ 0.5 and perplexity ratio ≤ 2 (1 se)" and m.metric == "joint"
    assert m.chosen.top1_ratio - m.chosen.top1_se >= 0.5 and m.chosen.ppl_ratio + m.chosen.ppl_se <= 2
    assert m.accuracy_target().met(m.chosen) and m.margin == 1.0 and m.target_level == 0.5


def test_on_a_mixture_of_texts_the_target_holds_on_each(setup, tmp_path):
    model, calib, text, root = setup
    other = root / "other.txt"
    items = (f"Item {i}: zebra, yacht, xylophone; {i * 7} waltzing vexed quails." for i in range(200))
    other.write_text("\n\n".join(items))
    args = ("export", model, "--calib", calib, "--eval-text", f"{text}+{other}", "--accuracy", 0.5)
    assert_user_error(run(*args, "--eval-tokens", 1024, "-o", tmp_path / "a"), "raise --eval-tokens to 2048",
                      tmp_path / "a")
    result = run(*args, "--eval-tokens", 2048, "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output
    m = Manifest.load(tmp_path / "b")
    assert len(m.chosen.parts) == 2 and all(len(p.parts) == 2 for p in m.curve)
    assert all(m.accuracy_target().met(p) for p in m.chosen.parts)


@pytest.mark.parametrize("method", ["aware", "zack"])
def test_export_writes_a_verifiable_hf_directory(setup, tmp_path, method):
    out = tmp_path / "exported"
    result = _export(setup, out, "--accuracy", 0.9, "--method", method)
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert m.method == method and m.chosen.top1_ratio >= 0.9 and len(m.curve) >= 2
    assert set(m.files) == {p.name for p in out.iterdir()} - {"kvfold.json"}
    assert all(sha256_file(out / name) == sha for name, sha in m.files.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["KVFoldLlamaForCausalLM"] and config["kvfold"]["d_k"] == m.d_k
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors |= load_file(f)
    assert set(m.extra_tensors) <= set(tensors) and len(m.extra_tensors) == 2 * 3  # 2 layers × (q, k, the key shift)
    d_v = sum(m.d_v[0])
    assert tensors["model.layers.0.self_attn.v_proj.weight"].shape == (d_v, 64)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (64, 2 * d_v)  # group of 2
    assert tensors["model.layers.0.self_attn.kvfold_k_post"].shape == (16, sum(m.d_k[0]))
    assert (out / "tokenizer.json").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~umask}  # shareable, like any HF dir


def test_ratio_target(setup, tmp_path):
    out = tmp_path / "r"
    result = _export(setup, out, "--ratio", 0.25)
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert m.chosen.compression >= 0.25 and m.target == "compression>=0.25"


def test_manifest_round_trips_and_rejects_unknown_major(setup, tmp_path):
    out = tmp_path / "m"
    assert _export(setup, out, "--ratio", 0.1).exit_code == 0
    m = Manifest.load(out)
    assert Manifest.from_json(m.to_json()) == m
    raw = json.loads(m.to_json())
    old = {k: v for k, v in raw.items() if not k.startswith(("allocation", "layer_"))} | {"schema_version": "1.0"}
    assert Manifest.from_json(json.dumps(old)).allocation == "eq6"  # 1.0 files (before allocation) still load
    new_fields = ("ppl_se", "agreement", "agreement_se", "kl", "kl_se", "kl_p99")

    def v11(point):
        return {k: v for k, v in point.items() if k not in new_fields} | {"ppl_ratio": 1 / point["ppl_ratio"]}

    old = {k: v for k, v in raw.items() if k not in ("target_level", "margin")} | {
        "schema_version": "1.1", "metric": "top1", "target": "top1 - 1.0*se>=0.5", "chosen": v11(raw["chosen"]),
        "curve": [v11(p) for p in raw["curve"]]}
    upgraded = Manifest.from_json(json.dumps(old))  # 1.1: ppl₀/ppl and the target as one string
    assert upgraded.chosen.ppl_ratio == pytest.approx(m.chosen.ppl_ratio) and math.isnan(upgraded.chosen.kl)
    assert upgraded.accuracy_target() == Target("top1", 0.5, 1.0)
    raw["schema_version"] = "2.0"
    with pytest.raises(KVFoldError, match=r"schema version '2\.0'"):
        Manifest.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--accuracy", 0], "--accuracy: Input should be greater than 0"),
        (["--accuracy", 1.5], "--accuracy: Input should be less than or equal to 1"),
        (["--accuracy", 0.9, "--ratio", 0.1], "options: give exactly one of accuracy, ratio or max_kl"),
        ([], "options: give exactly one of accuracy, ratio or max_kl"),
        (["--accuracy", 0.9, "--method", "magic"], "--method: Input should be 'aware' or 'zack'"),
        (["--accuracy", 0.9, "--metric", "bleu"], "--metric: Input should be 'joint', 'top1', 'ppl', 'agree' or 'kl'"),
        (["--accuracy", 0.9, "--recipe", "/nonexistent.yaml"], "recipe '/nonexistent.yaml' does not exist"),
    ],
)
def test_bad_options(setup, tmp_path, args, pattern):
    out = tmp_path / "o"
    assert_user_error(_export(setup, out, *args), pattern, out)


def test_calibration_of_another_model_is_rejected(setup, tiny_dirs, tmp_path):
    _, calib, text, _ = setup
    out = tmp_path / "o"
    result = run("export", tiny_dirs["Qwen2ForCausalLM"], "--calib", calib, "--eval-text", text,
                 "--accuracy", 0.9, "-o", out)
    assert_user_error(result, "calibrated on different weights", out)


def test_corrupted_calibration_is_rejected(setup, tmp_path):
    model, calib, text, _ = setup
    bad = tmp_path / "calib"
    bad.mkdir()
    for f in calib.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    stats = bad / "stats.safetensors"
    stats.write_bytes(stats.read_bytes()[:-10])
    out = tmp_path / "o"
    result = run("export", model, "--calib", bad, "--eval-text", text, "--accuracy", 0.9, "-o", out)
    assert_user_error(result, "corrupted", out)


def test_existing_output_needs_force(setup, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    assert_user_error(_export(setup, out, "--accuracy", 0.9), "already exists; pass --force")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel", "Qwen3ForCausalLM"])
def test_full_rank_export_from_disk_reproduces_logits(arch, tiny_dirs, tmp_path):
    """Acceptance 1 through the files: --ratio 0 with rank rounding 1 keeps every dim."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.reference import load_baked, padded_forward

    calib, out = tmp_path / "c", tmp_path / "o"
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"line {i} of some text" for i in range(50)))
    assert run("calibrate", tiny_dirs[arch], "-o", calib, "--tokens", 256, "--seq-len", 64).exit_code == 0
    result = run("export", tiny_dirs[arch], "--calib", calib, "--eval-text", text, "--eval-tokens", 128,
                 "--ratio", 0, "--multiple", 1, "--min-rank", 16, "-o", out)
    assert result.exit_code == 0, result.output
    model, adapter, m = load_baked(out)
    assert m.chosen.compression == 0.0
    original = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), padded_forward(model, adapter, m.d_k, m.d_v):
        got = model(input_ids=ids).logits
        want = original(input_ids=ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_rope_statistics_are_averaged_over_the_context(setup, tmp_path):
    """RoPE models are fitted to every position up to the model's context by default (--context sets it, 0
    keeps the calibration's positions); the manifest records it, and a reused curve keeps its own."""
    runs = {"default": (), "short": ("--context", 1024), "as calibrated": ("--context", 0)}
    k_post = {}
    for name, extra in runs.items():
        assert _export(setup, tmp_path / name, "--ratio", 0.25, *extra).exit_code == 0
        m = Manifest.load(tmp_path / name)
        assert m.positions == {"default": 256, "short": 1024, "as calibrated": None}[name]
        tensors = {k: v for f in sorted((tmp_path / name).glob("*.safetensors")) for k, v in load_file(f).items()}
        k_post[name] = next(v for k, v in sorted(tensors.items()) if k.endswith("kvfold_k_post"))
    # other statistics, other post-RoPE key projections
    assert k_post["default"].shape != k_post["as calibrated"].shape or \
        not torch.allclose(k_post["default"], k_post["as calibrated"], atol=1e-3)
    mismatch = _export(setup, tmp_path / "m", "--ratio", 0.25, "--context", 0, "--reuse-curve", tmp_path / "default")
    assert_user_error(mismatch, "was fitted for --context 256", tmp_path / "m")


def test_reuse_curve_evaluates_nothing(setup, tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    assert _export(setup, first, "--accuracy", 0.8).exit_code == 0
    prev = Manifest.load(first)

    def no_evaluation(*args, **kwargs):
        raise AssertionError("--reuse-curve must not evaluate")

    monkeypatch.setattr("kvfold.plan.planner.Evaluator", no_evaluation)
    # a stricter target that the curve can answer (accuracy ≤ 1)
    target = sorted(p.top1_ratio for p in prev.curve if p.top1_ratio <= 1)[-1]
    result = _export(setup, second, "--accuracy", target, "--metric", "top1", "--reuse-curve", first)
    assert result.exit_code == 0, result.output
    m = Manifest.load(second)
    assert m.curve == prev.curve and m.chosen in prev.curve and m.chosen.top1_ratio >= target
    assert m.target == f"top-1 ratio ≥ {target:.5g}" and m.metric == "top1"
    # the same curve under another metric: every point carries every figure
    by_kl = _export(setup, tmp_path / "k", "--max-kl", max(p.kl for p in prev.curve), "--reuse-curve", first)
    assert by_kl.exit_code == 0, by_kl.output
    assert Manifest.load(tmp_path / "k").chosen.compression == max(p.compression for p in prev.curve)
    mismatch = _export(setup, tmp_path / "c", "--accuracy", 0.8, "--method", "zack", "--reuse-curve", first)
    assert_user_error(mismatch, "was searched with a different method", tmp_path / "c")


def test_bfloat16_search_writes_the_sources_dtype(setup, tmp_path):
    """--dtype sets what the model runs in while candidates are scored; the weights written are baked from the
    source's own float32 weights (a full-rank bfloat16 search still reproduces the float32 logits), and the
    manifest records the search's dtype, which a reused curve must match."""
    from tests.reference import load_baked, padded_forward

    out = tmp_path / "bf16"
    result = _export(setup, out, "--ratio", 0, "--multiple", 1, "--min-rank", 16, "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    model, adapter, m = load_baked(out)
    assert m.search_dtype == "bfloat16"
    tensors = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert {v.dtype for v in tensors.values()} == {torch.float32}
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), padded_forward(model, adapter, m.d_k, m.d_v):
        got, want = model(input_ids=ids).logits, original(input_ids=ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    mismatch = _export(setup, tmp_path / "m", "--ratio", 0, "--multiple", 1, "--min-rank", 16, "--reuse-curve", out)
    assert_user_error(mismatch, "was searched with a different --dtype", tmp_path / "m")


def test_a_search_model_read_again_for_the_bake_is_freed_first(setup, tmp_path, monkeypatch):
    """Issue 52: searched in another dtype than the source's, the model baked is read again, and the search's model
    is gone by then (one model at a time); the bake then replaces its projections in place, copying nothing."""
    import types
    import weakref

    from kvfold.plan import planner

    loaded, load = [], planner.load_model

    def tracked(*args, **kwargs):
        assert all(ref() is None for ref in loaded), "a model planned earlier is still alive"
        model = load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model

    monkeypatch.setattr(planner, "load_model", tracked)
    no_copy = types.SimpleNamespace(deepcopy=lambda *a, **k: pytest.fail("the bake copied the model"))
    monkeypatch.setattr("kvfold.rewrite.bake.copy", no_copy)
    result = _export(setup, tmp_path / "bf16", "--ratio", 0.3, "--multiple", 1, "--min-rank", 4, "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert len(loaded) == 2  # the search's (bfloat16), then the source's float32 weights for the bake


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", ["calibrate", "export"])
def test_device_cuda_without_a_gpu_is_one_line(setup, tmp_path, command):
    model, calib, text, _ = setup
    out = tmp_path / "o"
    args = ("--tokens", 64, "--seq-len", 32) if command == "calibrate" else ("--calib", calib, "--eval-text", text,
                                                                           "--ratio", 0.1)
    result = run(command, model, *args, "--device", "cuda", "-o", out)
    assert_user_error(result, "--device cuda: this torch sees no CUDA device", out)
    assert_user_error(run(command, model, *args, "--device", "tpu", "-o", out), "--device must be one of", out)


def test_the_chosen_points_pass_keys_are_checked_and_recorded(tmp_path):
    """An accuracy export checks its chosen point's pass keys (plan/longrange.py) and records the check: here on
    the tiny Llama given a 1,024-token context, so the prompts fit and the check really runs."""
    model = save_tiny(tmp_path / "model", LLAMA, max_position_embeddings=1024)
    text = write_tiny_text(tmp_path / "eval.txt")
    assert run("calibrate", model, "-o", tmp_path / "calib", "--tokens", 512, "--seq-len", 64).exit_code == 0
    result = _export((model, tmp_path / "calib", text, tmp_path), tmp_path / "a", "--accuracy", 0.8, "--passkey", 512)
    assert result.exit_code == 0, result.output
    record = Manifest.load(tmp_path / "a").passkey
    assert record is not None and "skipped" not in record, record
    assert record["context"] <= 512 and record["prompts"] > 0 and record["retrieved"] >= record["original"]


def test_pass_keys_without_room_are_recorded_as_skipped_and_passkey_0_skips(setup, tmp_path):
    """On a 256-token context there is no room for the task: recorded as skipped, with the reason; --passkey 0
    skips the check (no record), and a length under 256 is refused."""
    assert _export(setup, tmp_path / "a", "--accuracy", 0.8).exit_code == 0
    record = Manifest.load(tmp_path / "a").passkey
    assert record is not None and "no room" in record["skipped"], record
    assert _export(setup, tmp_path / "b", "--accuracy", 0.8, "--passkey", 0).exit_code == 0
    assert Manifest.load(tmp_path / "b").passkey is None
    assert_user_error(_export(setup, tmp_path / "c", "--accuracy", 0.8, "--passkey", 100),
                      "passkey must be 0 (skip) or at least 256 tokens", tmp_path / "c")


def test_search_steps_below_one_are_refused(setup, tmp_path):
    assert_user_error(_export(setup, tmp_path / "o", "--accuracy", 0.8, "--search-steps", 0),
                      "--search-steps: Input should be greater than or equal to 1", tmp_path / "o")


def test_export_help_reads_its_defaults_from_the_recipe():
    """The defaults are defined once, in plan/recipe.py; export's help shows them from there."""
    from kvfold.plan.recipe import Recipe

    shown = run("export", "--help")
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.stdout.replace("│", " ").split())
    for option, words in [("eval_tokens", "score on"), ("multiple", "multiple of this"), ("min_rank", "any head"),
                          ("passkey", "as the original"), ("method", "(the papers')"),
                          ("search_steps", "a milder point")]:
        assert f"{words} [{Recipe.model_fields[option].default}]" in text, option
    assert f"unfavourable side [{Recipe.model_fields['margin'].default:g}]" in text
