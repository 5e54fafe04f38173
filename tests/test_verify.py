"""kvfold verify on a real (tiny) export: passes when intact, names the problem when tampered with."""

import json
import shutil

import pytest

from tests.test_cli import assert_user_error, run

LLAMA = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def exported(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    text = root / "eval.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    calib, out = root / "calib", root / "exported"
    assert run("calibrate", tiny_dirs[LLAMA], "-o", calib, "--tokens", 512, "--seq-len", 64).exit_code == 0
    result = run("export", tiny_dirs[LLAMA], "--calib", calib, "--eval-text", text, "--eval-tokens", 256,
                 "--ratio", 0.3, "--multiple", 1, "--min-rank", 4, "-o", out)
    assert result.exit_code == 0, result.output
    return out, text


def _verify(path, text, *extra):
    return run("verify", path, "--eval-text", text, "--eval-tokens", 256, "--json", *extra)


def _copy(exported, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(exported[0], dst)
    return dst


def test_an_intact_export_passes(exported):
    result = _verify(*exported)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    manifest = json.loads((exported[0] / "kvfold.json").read_text())
    assert report["ok"] and {c["name"] for c in report["checks"]} == {
        "manifest", "files", "config", "shapes", "loads", f"fidelity {exported[1]}", "kv_bytes"}
    # same text as the search: the served files reproduce the recorded ratios
    (text,) = report["texts"]
    assert text["top1_ratio"] == pytest.approx(manifest["chosen"]["top1_ratio"], abs=0.01)
    assert text["ppl_ratio"] == pytest.approx(manifest["chosen"]["ppl_ratio"], abs=1e-3)
    assert text["kl"] == pytest.approx(manifest["chosen"]["kl"], rel=1e-2) and text["kl"] > 0
    assert 0 < text["agreement"] < 1 and text["kl_p99"] >= text["kl"]
    assert report["kv_bytes_ratio"] == pytest.approx(1 - manifest["chosen"]["compression"], abs=1e-12)
    gen = report["generation"]
    assert report["kv_bytes_ratio"] < 1 and len(gen["runs"]) == 4 and gen["forced_tokens"] == 4 * 32
    assert report["kv_fraction_at"] == {}  # the same fraction at every length
    assert all(r["new_tokens"] == 32 for r in gen["runs"]) and 0 <= gen["forced_agreement"] <= 1
    # the tiny model's 256 positions hold no passkey prompt: said, not failed
    assert "context of 256 tokens is too short" in report["passkey"]["skipped"]


def test_the_passkey_check_counts_the_keys_each_model_retrieves():
    from kvfold.verify.report import VerifyReport
    from kvfold.verify.serving import _passkey
    from tests.conftest import build_tiny, tiny_tokenizer

    model = build_tiny(LLAMA)
    model.config.max_position_embeddings = 4096
    report = VerifyReport(export="x")
    _passkey(tiny_tokenizer(), model, model, 1024, report)
    (check,) = report.checks
    assert check.name == "passkey 1024" and check.ok and "needle at depths 0.1, 0.3, 0.5, 0.7, 0.9" in check.detail
    exported = dict(report.passkey["exported"])
    # the same model served: the same answers, and the answers' NLL changes by exactly nothing
    assert exported.pop("answer_nll_change") == {"mean": 0.0, "se": 0.0}
    assert report.passkey["original"] == exported and exported["prompts"] == 10


def _failed(result) -> dict[str, str]:
    assert result.exit_code == 1, result.output
    return {c["name"]: c["detail"] for c in json.loads(result.stdout)["checks"] if not c["ok"]}


def test_a_flipped_byte_in_a_shard_fails(exported, tmp_path):
    copy = _copy(exported, tmp_path)
    shard = next(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the tensor data: the file still parses
    shard.write_bytes(bytes(data))
    assert f"{shard.name} differs from the manifest (sha256)" in _failed(_verify(copy, exported[1]))["files"]


def test_an_edited_rank_in_the_manifest_fails(exported, tmp_path):
    copy = _copy(exported, tmp_path)
    manifest = json.loads((copy / "kvfold.json").read_text())
    manifest["d_k"][0][0] -= 1
    (copy / "kvfold.json").write_text(json.dumps(manifest))
    failed = _failed(_verify(copy, exported[1]))
    assert "d_k/d_v differ" in failed["config"]
    assert "kvfold_k_post has shape" in failed["shapes"]


def test_a_deleted_file_fails(exported, tmp_path):
    copy = _copy(exported, tmp_path)
    (copy / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in _failed(_verify(copy, exported[1]))["files"]


def test_an_unlisted_weight_file_fails(exported, tmp_path):
    copy = _copy(exported, tmp_path)
    shutil.copy(next(copy.glob("*.safetensors")), copy / "extra.safetensors")
    assert "extra.safetensors is not listed" in _failed(_verify(copy, exported[1]))["files"]


def test_not_a_kvfold_directory_is_bad_input(tiny_dirs, exported, tmp_path):
    assert_user_error(_verify(tiny_dirs[LLAMA], exported[1]), "is not a kvfold export")
    assert_user_error(_verify(tmp_path / "nowhere", exported[1]), "is not a directory")


def test_new_tokens_sets_the_generations_length(exported):
    """--new-tokens: the greedy tokens each prompt generates in both models (the real-model tests shorten it)."""
    result = _verify(*exported, "--new-tokens", 5)
    assert result.exit_code == 0, result.output
    gen = json.loads(result.stdout)["generation"]
    assert all(r["new_tokens"] == 5 for r in gen["runs"]) and gen["forced_tokens"] == 4 * 5
    assert_user_error(_verify(*exported, "--new-tokens", 0), "--new-tokens must be at least 1")


def test_against_another_model_fails(exported, tiny_dirs):
    failed = _failed(_verify(*exported, "--against", tiny_dirs["Qwen2ForCausalLM"]))
    assert "is not the model this was exported from" in failed["against"]


def _mixed_gemma3(folder):
    """The tiny Gemma 3 with one sliding (window 16) and one full-attention layer, as real Gemma 3 mixes them."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS, tiny_tokenizer

    config = TINY_CONFIGS["Gemma3ForCausalLM"]()
    config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.config.architectures = ["Gemma3ForCausalLM"]
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Gemma3ForCausalLM"])
def test_sliding_window_exports_verify_at_a_context_past_the_window(tiny_dirs, tmp_path, arch):
    """Sliding-window layers hold only their window (16 here) of the 256-token window verify runs; with
    sliding and full layers of different widths (Gemma 3) the live cache is not (1 − p) × the original's:
    the check expects each layer's own token count."""
    source = _mixed_gemma3(tmp_path / "gemma3") if arch == "Gemma3ForCausalLM" else tiny_dirs[arch]
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    calib, out = tmp_path / "calib", tmp_path / "exported"
    assert run("calibrate", source, "-o", calib, "--tokens", 512, "--seq-len", 64).exit_code == 0
    result = run("export", source, "--calib", calib, "--eval-text", text, "--eval-tokens", 256,
                 "--ratio", 0.3, "--multiple", 1, "--min-rank", 4, "-o", out)
    assert result.exit_code == 0, result.output
    result = _verify(out, text)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and {c["name"]: c["ok"] for c in report["checks"]}["kv_bytes"]
    assert report["kv_bytes_ratio"] == pytest.approx(report["expected_kv_bytes_ratio"], abs=1e-12)
    p = json.loads((out / "kvfold.json").read_text())["chosen"]["compression"]
    if arch == "Gemma3ForCausalLM":
        assert report["kv_bytes_ratio"] != pytest.approx(1 - p, abs=1e-6)


def test_the_kv_bytes_expectation_catches_a_wrong_rank(exported):
    import torch
    from transformers import AutoModelForCausalLM

    import kvfold_runtime
    from kvfold.sources.models import load_model, resolve_model
    from kvfold.verify.serving import expected_kv_bytes
    from kvfold_runtime import ConfigBlock

    manifest = json.loads((exported[0] / "kvfold.json").read_text())
    served = AutoModelForCausalLM.from_pretrained(exported[0], dtype=torch.float32).eval()
    original = load_model(resolve_model(manifest["source"]["path"]))
    ids = torch.arange(40)[None] % 200
    with torch.inference_mode():
        want = expected_kv_bytes(original(input_ids=ids, use_cache=True).past_key_values,
                                 ConfigBlock(manifest["d_k"], manifest["d_v"], True))
        live = kvfold_runtime.kv_cache_bytes(served(input_ids=ids, use_cache=True).past_key_values)
    assert live == want
    wrong = [list(r) for r in manifest["d_k"]]
    wrong[0][0] -= 1
    with torch.inference_mode():
        assert expected_kv_bytes(original(input_ids=ids, use_cache=True).past_key_values,
                                 ConfigBlock(wrong, manifest["d_v"], True)) != live


def test_held_out_text_checks_the_exports_target_within_two_standard_errors(exported):
    from kvfold.checkpoint.manifest import Manifest
    from kvfold.plan.point import Point
    from kvfold.verify.serving import _fidelity

    m = Manifest.load(exported[0]).model_copy(update={"metric": "joint", "target_level": 0.99, "margin": 1.0})

    def held_out(top1, ppl):
        return _fidelity(m, "pydoc:eval", 16000, Point(0, 0, 0.1, top1, ppl, top1_se=0.003, ppl_se=0.004,
                                                             kl=0.01))

    assert held_out(0.992, 1.009).ok and held_out(0.985, 1.0).ok  # 0.985 + 2·0.003 ≥ 0.99
    assert not held_out(0.983, 1.0).ok and not held_out(1.0, 1.0202).ok
    check = held_out(0.992, 1.009)
    assert check.name == "target pydoc:eval" and "perplexity ratio 1.0090 ± 0.0040" in check.detail
    assert "mean KL 0.01000" in check.detail and "within 2 standard errors" in check.detail


def test_an_agreement_target_checks_the_generations_and_other_text_its_target(tiny_dirs, exported, tmp_path):
    """Export for top-1 agreement (searched on one text), verify on a second text: the held-out check is
    the target, and the greedy generations' agreement becomes a check with its stated floor."""
    calib = exported[0].parent / "calib"
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Line {i}: pack my box with five dozen liquor jugs." for i in range(60)))
    out = tmp_path / "agree"
    result = run("export", tiny_dirs[LLAMA], "--calib", calib, "--eval-text", exported[1], "--eval-tokens", 1024,
                 "--accuracy", 0.5, "--metric", "agree", "--multiple", 1, "--min-rank", 4, "-o", out)
    assert result.exit_code == 0, result.output
    report = json.loads(run("verify", out, "--eval-text", other, "--eval-text", exported[1], "--eval-tokens", 1024,
                            "--json").stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert f"target {other}" in checks and f"fidelity {exported[1]}" in checks
    assert "top-1 agreement" in checks[f"target {other}"]["detail"]
    assert "generation" in checks and "agreement target 0.5" in checks["generation"]["detail"]
    assert [t["eval_text"] for t in report["texts"]] == [str(other), str(exported[1])]


def test_pydoc_is_a_second_domain_that_ships_with_python():
    from kvfold.errors import KVFoldError
    from kvfold.sources.text import Mixture, resolve_text

    dev, evaluation = resolve_text("pydoc:dev"), resolve_text("pydoc:eval")
    assert min(len(dev), len(evaluation)) > 30 and sum(map(len, dev + evaluation)) > 300_000
    assert resolve_text("pydoc") == evaluation and not set(dev) & set(evaluation)
    assert resolve_text("pydoc:eval") == evaluation  # same order every time
    mix = resolve_text("wiki:dev+pydoc:dev")
    assert isinstance(mix, Mixture) and mix.parts == (resolve_text("wiki:dev"), dev)
    for bad, msg in [("pydoc:calib", "use pydoc:dev or pydoc:eval"), ("wiki:dev+", r"mixes texts as A\+B"),
                     ("wiki:dev+wiki:dev", "each text named once")]:
        with pytest.raises(KVFoldError, match=msg):
            resolve_text(bad)


def test_a_bits_format_export_verifies_and_its_cache_holds_the_band_bytes(tiny_dirs, exported, tmp_path):
    """export --format bits: the accuracy search over the water-filling's θ, bit widths in the manifest and
    config.json, and verify passes — its fidelity re-measured on the served model (whose cache stores the
    codes) and its live cache bytes equal to the bands' row bytes exactly."""
    from kvfold.checkpoint.manifest import Manifest
    from kvfold_runtime.bands import bands_from_bits, row_bytes

    calib, out = exported[0].parent / "calib", tmp_path / "bits"
    result = run("export", tiny_dirs[LLAMA], "--calib", calib, "--eval-text", exported[1], "--eval-tokens", 1024,
                 "--accuracy", 0.9, "--format", "bits", "-o", out)
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert m.k_bits is not None and [[len(h) for h in layer] for layer in m.k_bits] == m.d_k
    assert all(b in (2, 3, 4, 5, 6, 8, 16) for side in (m.k_bits, m.v_bits) for layer in side for h in layer
               for b in h)
    block = json.loads((out / "config.json").read_text())["kvfold"]
    assert block["v_bits"] == m.v_bits and block["band_scale"] == m.band_scale == "log8"
    per_token = sum(row_bytes(bands_from_bits(h)) for side in (m.k_bits, m.v_bits) for layer in side for h in layer)
    fp16 = 2 * 2 * m.head_dim * m.num_kv_heads * len(m.d_k)
    # it compresses (how far a random tiny model goes at 0.9 says nothing: 0.20–0.79 as V_SCALE moves 8–64)
    assert m.chosen.compression == pytest.approx(1 - per_token / fp16) and m.chosen.compression > 0.1
    assert m.accuracy_target().met(m.chosen) and len(m.curve) >= 3
    done = run("verify", out, "--eval-text", exported[1], "--eval-tokens", 1024, "--json")
    assert done.stdout, done.output
    report = json.loads(done.stdout)
    assert report["ok"], report["checks"]
    assert report["kv_bytes_per_token"]["exported"] == per_token
    assert_user_error(run("export", tiny_dirs[LLAMA], "--calib", calib, "--ratio", 0.5, "--format", "bits",
                      "-o", tmp_path / "x"), "--accuracy or --max-kl", tmp_path / "x")


def test_a_windowed_bits_export_records_its_whole_tokens_and_verifies(tiny_dirs, exported, tmp_path):
    """export --format bits --sinks 2 --window 8 (issue 51): searched on the cache that keeps those tokens whole, keys
    down to 2 bits (the windowed default where no pass key binds: --passkey 0; recorded in the manifest), in
    128-token windows scored from position 48 on (--search-context, --score-from); the counts in the manifest and
    config.json, its compression stated at 4,096 tokens with the whole rows counted; verify passes on the served
    model, scoring the search's windows by default, whose live cache holds the codes of every token and the whole
    rows of the first 2 and last 8 (in float32: verify's dtype). The rank format refuses the flags (one line)."""
    from dataclasses import replace

    from kvfold.checkpoint.manifest import Manifest

    calib, out = exported[0].parent / "calib", tmp_path / "windowed"
    result = run("export", tiny_dirs[LLAMA], "--calib", calib, "--eval-text", exported[1], "--eval-tokens", 1024,
                 "--accuracy", 0.9, "--format", "bits", "--passkey", 0, "--sinks", 2, "--window", 8,
                 "--search-context", 128, "--score-from", 48, "-o", out)
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert "at 4,096 tokens with the first 2 and last 8 kept whole" in said and "keys at 2 bits or more" in said
    m = Manifest.load(out)
    block = m.config_block()
    assert (m.sinks, m.window, m.search_context, m.score_from) == (2, 8, 128, 48) and block.windowed
    assert m.key_bits == 2 and m.previous_export(out).key_bits == 2  # recorded for a reused curve
    again = run("export", tiny_dirs[LLAMA], "--calib", calib, "--accuracy", 0.9, "--format", "bits", "--passkey", 0,
                "--sinks", 2, "--window", 8, "--search-context", 128, "--score-from", 48, "--reuse-curve", out,
                "-o", tmp_path / "again")  # the key floor it chose is the reused curve's, without --key-bits
    assert again.exit_code == 0, again.output
    assert Manifest.load(tmp_path / "again").key_bits == 2
    assert {k: json.loads((out / "config.json").read_text())["kvfold"][k] for k in ("sinks", "window")} == \
        {"sinks": 2, "window": 8}
    fp16 = 2 * 2 * m.head_dim * m.num_kv_heads * len(m.d_k)
    assert m.chosen.compression == pytest.approx(1 - block.bytes_per_token(context=4096) / fp16)
    done = run("verify", out, "--eval-text", exported[1], "--eval-tokens", 1024, "--json")
    report = json.loads(done.stdout)
    assert report["ok"], report["checks"]
    assert {(t["context"], t["score_from"]) for t in report["texts"]} == {(128, 48)}  # the search's windows
    coded = replace(block, sinks=0, window=0).bytes_per_token()
    whole = 4 * (sum(map(sum, m.d_k)) + sum(map(sum, m.d_v)))
    tokens = 128  # verify's live-cache prompt (serving.KV_BYTES_TOKENS)
    assert report["kv_bytes_per_token"]["exported"] == pytest.approx(coded + whole * (2 + 8) / tokens)
    # the live cache of 128 tokens is mostly whole rows; the fraction a user serves at length is stated beside it
    assert report["kv_fraction_at"] == {str(n): pytest.approx(block.bytes_per_token(context=n) / fp16)
                                        for n in (128, 32768)}
    assert report["kv_fraction_at"]["32768"] < report["kv_fraction_at"]["128"]
    assert "of float16 at 32,768 tokens" in {c["name"]: c["detail"] for c in report["checks"]}["kv_bytes"]
    assert_user_error(run("export", tiny_dirs[LLAMA], "--calib", calib, "--accuracy", 0.9, "--window", 8,
                          "-o", tmp_path / "x"), "--sinks and --window keep tokens whole", tmp_path / "x")


def test_verify_holds_the_unchanged_weights_once(tiny_dirs, exported):
    """Issue 52: the original verify compares against is built around the served model's tensors; only the
    attention projections the export changed are its own, and it computes what the source loaded alone does."""
    import torch

    from kvfold.sources.models import load_model, resolve_model
    from kvfold.verify.pair import load_original_beside, shared_parameters
    from kvfold.verify.serving import load_served

    ref = resolve_model(str(tiny_dirs[LLAMA]))
    served = load_served(exported[0])
    original = load_original_beside(served, ref)
    alone = load_model(ref)
    shared, total = shared_parameters(original, served)
    own = {n for n, p in original.named_parameters() if p.data_ptr() != dict(served.named_parameters())[n].data_ptr()}
    assert own and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for n in own)
    assert shared == total - len(own) and shared > len(own)
    assert type(original) is type(alone) and original.generation_config == alone.generation_config
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(original(input_ids=ids).logits, alone(input_ids=ids).logits)
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), alone.state_dict().values(),
                                                   strict=True))
