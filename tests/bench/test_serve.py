"""`kvfold-bench serve`: bad input refused before any engine starts (one line, exit 2), its arithmetic and
probe verdict, the table and the PNG; marked vllm, a real run of every kind of configuration on a tiny
model (the SmolLM2 run is tests/runtime/test_vllm.py::test_bench_serve_prints_capacity_on_real_weights)."""

import ast
import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfold_bench.cli import app
from kvfold_bench.serve import KV_DTYPES, capacity_figures, layout_capacities, round_figures
from kvfold_bench.serve_point import agreement, reads_back
from tests.runtime.conftest import write_export
from tests.runtime.vllm_engine import ENGINE_IN_PROCESS
from tests.test_cli import assert_user_error


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("args, message", [
    (["serve", "--export", "{tmp}"], "is not a kvfold export"),
    (["serve", "--export", "{tmp}", "--requests", "0"], "--requests must be at least 1"),
    (["serve", "--export", "{tmp}", "--kv-cache-mib", "0"], "--kv-cache-mib must be at least 1"),
    (["serve", "--export", "{tmp}", "--long-prompt-tokens", "0"], "--long-prompt-tokens must be at least 1"),
    (["serve", "--export", "{tmp}", "--long-new-tokens", "1"], "--long-new-tokens must be at least 2"),
    (["serve", "--export", "{tmp}", "--workload", "some"], "--workload must be one of all, limited, long, none"),
    (["serve", "--export", "{tmp}", "--kv-cache-dtype", "int8"], "--kv-cache-dtype 'int8' is not one of vLLM"),
    (["serve", "--export", "{tmp}", "--dtype", "int8"], "--dtype must be one of"),
    (["serve", "--export", "{tmp}", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    (["serve", "--export", "{tmp}", "--rounds", "0"], "--rounds must be at least 1"),
    (["serve", "--export", "{tmp}", "--paired-steps", "-1"], "--paired-steps must be 0 (not run) or more"),
    (["serve", "--export", "{tmp}", "--png", "{tmp}/missing/serve.png"], "does not exist"),
    (["serve-point", "{tmp}/missing", "{tmp}", "{tmp}/point.json"], "does not exist"),
    (["openai", "--export", "{tmp}"], "is not a kvfold export"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    assert_user_error(run(*(a.format(tmp=tmp_path) for a in args)), message)


def test_exports_of_two_models_are_refused_before_any_engine(tiny_dirs, tmp_path):
    a = write_export("LlamaForCausalLM", tiny_dirs["LlamaForCausalLM"], tmp_path / "a", "uneven")
    b = write_export("Qwen2ForCausalLM", tiny_dirs["Qwen2ForCausalLM"], tmp_path / "b", "uneven")
    assert_user_error(run("serve", "--export", a.path, "--export", b.path), "different models")


def test_a_long_context_too_short_for_the_pass_keys_is_refused_before_any_engine(tiny_dirs, tmp_path):
    a = write_export("LlamaForCausalLM", tiny_dirs["LlamaForCausalLM"], tmp_path / "a", "uneven")
    assert_user_error(run("serve", "--export", a.path, "--long-prompt-tokens", "200"),
                      "--long-prompt-tokens 200 is too short to hide a pass key")


def test_kv_dtypes_are_the_installed_vllms_less_auto():
    """Read from vllm/config/cache.py's CacheDType without importing vLLM (seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    tree = ast.parse((Path(spec.submodule_search_locations[0]) / "config" / "cache.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CacheDType")
    assert [e.value for e in node.value.slice.elts] == ["auto", *KV_DTYPES]


def test_probe_agreement_and_verdict():
    ref = {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]], "top1": [[1, 1, 1, 1, 1]], "nll": [[1.0, 2.0, 3.0]]}
    same = agreement(ref, ref)
    assert same == {"greedy_tokens_equal": 8, "greedy_tokens": 8, "first_difference": [None, None],
                    "top1_agreement": 1.0, "ppl_ratio": 1.0}
    assert reads_back(same)
    # rounding: greedy text takes another path, the teacher-forced figures stay close -> it runs
    near = {"tokens": [[1, 9, 9, 9], [5, 6, 7, 8]], "top1": [[1, 1, 1, 1, 2]], "nll": [[1.1, 2.1, 3.1]]}
    got = agreement(near, ref)
    assert got["greedy_tokens_equal"] == 5 and got["first_difference"] == [1, None]
    assert got["top1_agreement"] == 0.8 and got["ppl_ratio"] == pytest.approx(1.1052, abs=1e-4) and reads_back(got)
    # a cache read back as something else: predictions and perplexity both off -> it does not run
    wrong = {"tokens": [[0, 0, 0, 0], [0, 0, 0, 0]], "top1": [[1, 3, 3, 3, 3]], "nll": [[4.0, 5.0, 6.0]]}
    got = agreement(wrong, ref)
    assert got["top1_agreement"] == 0.2 and got["ppl_ratio"] == pytest.approx(20.0855, abs=1e-3)
    assert not reads_back(got)


def test_an_engine_failure_is_named_by_its_root_cause():
    from kvfold_bench.engine_log import root_cause as _why

    crash = ("(EngineCore pid=1) ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit "
             "code: -11), shutting down executor.\n(EngineCore pid=1) ERROR [core.py:1512] RuntimeError: cancelled\n")
    assert _why(crash) == "vLLM's worker process died (exit code -11, a segmentation fault)"
    refused = "(EngineCore pid=1) NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU.\n"
    assert _why(refused) == "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU."
    assert _why("kvfold: the bits format is not served here\n" + crash) == "the bits format is not served here"
    # seen in CI: the worker raised, then died with exit code 0 before the engine's shutdown read None
    raised = ("(Worker pid=2) ERROR [multiproc_executor.py:1063] NotImplementedError: FP8 KV cache requires head_size "
              "divisible by 32 on CPU.\n(EngineCore pid=1) ERROR [core.py:1510] RuntimeError: Worker failed with error "
              "'FP8 KV cache requires head_size divisible by 32 on CPU.', please check the stack trace above\n"
              "(EngineCore pid=1) ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit "
              "code: 0), shutting down executor.\n")
    assert _why(raised) == "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU."
    # seen in CI: vLLM's ulimit warning quotes an OSError; the cause is the worker's crash, in a native frame
    ulimit = ("(APIServer pid=3) WARNING [system_utils.py:255] Found ulimit of 20000 and failed to automatically "
              "increase with error current limit exceeds maximum limit. This can cause fd limit errors like "
              "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n\n")
    segv = ("!!!!!!! Segfault encountered !!!!!!!\n  File \"./signal/../sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c"
            "\", line 0, in 0x00007f944645a04f\n  File \"/tmp/vllm/csrc/cpu/cpu_types_x86.hpp\", line 151, in "
            "vec_op::BF16Vec8::save(void*) const\n")
    assert _why(ulimit + segv + crash) == ("vLLM's worker process died (exit code -11, a segmentation fault in "
                                           "vec_op::BF16Vec8::save(void*) const (cpu_types_x86.hpp:151))")
    assert _why(ulimit + refused) == "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU."


def test_capacity_bytes_per_token_and_ratios():
    original = {"kv_blocks": 11, "block_size": 128, "kv_token_capacity": 1408, "kv_cache_memory_bytes": 64 << 20,
                "cache_limited": {"peak_running_requests": 2, "generated_tokens_per_s": 40.0},
                "long_context": {"decode_tokens_per_s": 10.0}}
    fp8 = {"kv_blocks": 45, "block_size": 128, "kv_token_capacity": 45 * 128, "kv_cache_memory_bytes": 64 << 20,
           "cache_limited": {"peak_running_requests": 8, "generated_tokens_per_s": 50.0}}
    got = capacity_figures(fp8, original)
    assert got["kv_token_capacity"] == 45 * 128
    assert got["bytes_per_token"] == round((64 << 20) / (45 * 128), 1) == 11650.8
    assert got["vs_original"] == {"kv_token_capacity": round(45 / 11, 4), "peak_running_requests": 4.0,
                                  "generated_tokens_per_s": 1.25}  # no long-context run: no decode ratio
    assert capacity_figures(original, original)["vs_original"] == {
        "kv_token_capacity": 1.0, "peak_running_requests": 1.0, "generated_tokens_per_s": 1.0,
        "decode_tokens_per_s": 1.0}


def test_rounds_give_each_rounds_ratio_to_the_same_rounds_original_and_their_median():
    def speeds(gen, decode):
        return {"cache_limited": {"generated_tokens_per_s": gen}, "long_context": {"decode_tokens_per_s": decode}}

    per_round = {"original": [speeds(40.0, 10.0), speeds(20.0, 8.0), speeds(40.0, 12.0)],
                 "export:bits": [speeds(60.0, 9.0), {}, speeds(50.0, 12.0)],  # round 2's engine failed
                 "fp8": [{"cache_limited": {"generated_tokens_per_s": 44.0}}] * 3}  # no long-context run
    got = round_figures(per_round)
    assert got["original"]["vs_original"] == {"generated_tokens_per_s": [1.0] * 3, "generated_tokens_per_s_median": 1.0,
                                              "decode_tokens_per_s": [1.0] * 3, "decode_tokens_per_s_median": 1.0}
    bits = got["export:bits"]
    assert bits["decode_tokens_per_s"] == [9.0, None, 12.0]
    assert bits["vs_original"]["decode_tokens_per_s"] == [0.9, None, 1.0]
    assert bits["vs_original"]["decode_tokens_per_s_median"] == 0.95  # of the rounds measured
    assert bits["vs_original"]["generated_tokens_per_s_median"] == 1.375  # 1.5 and 1.25
    assert got["fp8"]["vs_original"] == {"generated_tokens_per_s": [1.1, 2.2, 1.1],
                                         "generated_tokens_per_s_median": 1.1}


def test_paired_figures_are_medians_of_the_counted_steps_and_their_ratio_to_the_originals():
    from kvfold_bench.serve_paired import paired_figures

    ms = 1e-3
    turns = [{"original": [50 * ms, 52 * ms, 51 * ms], "export:bits": [45 * ms, 46 * ms, 47 * ms]},
             {"original": [60 * ms, 61 * ms, 62 * ms], "export:bits": [55 * ms, 54 * ms, 56 * ms]},  # drifted
             {"original": [51 * ms, 50 * ms, 52 * ms], "export:bits": [46 * ms, 45 * ms, 47 * ms]}]
    got = paired_figures(turns)
    assert got["original"] == {"decode_steps": 9, "ms_per_step": 52.0, "decode_tokens_per_s": 19.23,
                               "vs_original": 1.0, "vs_original_turn_quartiles": [1.0, 1.0]}
    bits = got["export:bits"]
    assert bits["decode_steps"] == 9 and bits["ms_per_step"] == 47.0 and bits["decode_tokens_per_s"] == 21.28
    assert bits["vs_original"] == round(52 / 47, 4) == 1.1064
    # each turn's median ratio 51/46, 61/55, 51/46; the quartiles of three (exclusive method): their least, greatest
    assert bits["vs_original_turn_quartiles"] == [round(51 / 46, 4), round(61 / 55, 4)] == [1.1087, 1.1091]


def test_layout_capacities_follow_vllms_page_formula():
    from types import SimpleNamespace

    m = SimpleNamespace(d_k=[[3, 5], [4, 4]], d_v=[[2, 2], [1, 6]])  # two layers, two KV heads each
    got = layout_capacities(m, budget=10_000, block_size=4, dtype="float32")
    # numbers per token: packed 3+5+2+2 + 4+4+1+6 = 27; padded 2·(5+2) + 2·(4+6) = 34
    assert got["packed"]["page_bytes"] == got["buckets"]["page_bytes"] == 4 * 27 * 4
    assert got["pad_to_layer_max"]["page_bytes"] == 4 * 34 * 4
    assert got["packed"]["kv_token_capacity"] == 10_000 // (4 * 27 * 4) * 4 == 92  # blocks × block size
    assert got["pad_to_layer_max"]["kv_token_capacity"] == 10_000 // (4 * 34 * 4) * 4 == 72
    assert got["buckets"]["attention_calls_per_step"] == 4 and got["packed"]["attention_calls_per_step"] == 2


def test_tensor_parallel_capacity_against_an_even_split():
    from types import SimpleNamespace

    from kvfold_bench.serve import tensor_parallel_figures
    from kvfold_runtime import ConfigBlock

    block = ConfigBlock([[8, 8], [8, 4]], [[8, 8], [4, 4]], True)  # float32: (32 + 20) · 4 = 208 bytes a token
    m = SimpleNamespace(config_block=lambda: block, tensor_parallel=1)
    even = {"kv_blocks": 10, "block_size": 4}  # 40 tokens in 4,160 bytes a rank: the even split's 104 a token
    got = tensor_parallel_figures(even, m, budget=4_160, dtype="float32", size=2)
    assert got["rank_ideal_kv_token_capacity"] == 40 and got["capacity_vs_ideal"] == 1 and got["within_3_percent"]
    padded = tensor_parallel_figures({"kv_blocks": 9, "block_size": 4}, m, budget=4_160, dtype="float32", size=2)
    assert padded["capacity_vs_ideal"] == 0.9 and not padded["within_3_percent"]


# A run's report, trimmed to three configurations (SmolLM2-135M, 64 MiB, float32, 8 × (256 + 256), 1 × (1024 + 128))
REPORT = {
    "benchmark": "serve", "engine": "vllm", "original": "SmolLM2-135M-Instruct", "dtype": "float32",
    "kv_cache_mib": 64, "kv_cache_memory_bytes": 64 << 20, "eager": True,
    "workloads": {"which": "all", "probe": {"prompts": 2, "prompt_tokens": 256, "greedy_tokens": 16},
                  "cache_limited": {"requests": 8, "prompt_tokens": 256, "new_tokens": 256, "tokens": 4096,
                                    "limits_original": True},
                  "long_context": {"prompt_tokens": 1024, "new_tokens": 128},
                  "paired_decode": {"context": 1024, "counted_steps_per_configuration": 128, "runs": True}},
    "configurations": {
        "original": {"kind": "original", "runs": True, "kv_blocks": 11, "block_size": 128, "kv_token_capacity": 1408,
                     "bytes_per_token": 47662.5, "vs_original": {"kv_token_capacity": 1.0},
                     "cache_limited": {"peak_running_requests": 4, "generated_tokens_per_s": 30.1},
                     "long_context": {"decode_tokens_per_s": 12.5},
                     "paired_decode": {"decode_tokens_per_s": 20.0, "vs_original": 1.0}},
        "export:rank": {"kind": "export", "runs": True, "kv_blocks": 15, "block_size": 128, "kv_token_capacity": 1920,
                        "bytes_per_token": 34952.5, "vs_original": {"kv_token_capacity": 1.3636},
                        "probe": {"greedy_tokens_equal": 9, "greedy_tokens": 32, "top1_agreement": 0.81,
                                  "ppl_ratio": 1.3},
                        "cache_limited": {"peak_running_requests": 6, "generated_tokens_per_s": 25.0},
                        "long_context": {"decode_tokens_per_s": 9.0},
                        "paired_decode": {"decode_tokens_per_s": 19.8, "vs_original": 0.9876}},
        "int8_per_token_head": {"kind": "kv_cache_dtype", "runs": False, "reason": "the cache is not read back",
                                "kv_blocks": 45, "block_size": 128, "kv_token_capacity": 5760,
                                "bytes_per_token": 11650.8, "vs_original": {"kv_token_capacity": 4.0909},
                                "probe": {"greedy_tokens_equal": 0, "greedy_tokens": 32, "top1_agreement": 0.01,
                                          "ppl_ratio": 900.0}},
    },
}


def test_table_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    from rich.console import Console

    from kvfold_bench.serve_view import draw, serve_table

    console = Console(width=200, record=True)
    console.print(serve_table(REPORT))
    text = console.export_text()
    assert "export:rank" in text and "1.364" in text and "4.091" in text and "0.010" in text and "900" in text
    assert "paired ×" in text and "0.988" in text
    draw(REPORT, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only = {k: v for k, v in REPORT["workloads"].items() if k in ("probe", "cache_limited")}
    draw({**REPORT, "workloads": {**only, "which": "limited"}}, tmp_path / "limited.png")
    draw({**REPORT, "workloads": {"which": "none", "probe": only["probe"]}}, tmp_path / "capacity.png")
    unpaired = {name: {k: v for k, v in c.items() if k != "paired_decode"}
                for name, c in REPORT["configurations"].items()}
    draw({**REPORT, "configurations": unpaired}, tmp_path / "unpaired.png")


@pytest.fixture
def head80(tmp_path):
    """A tiny random Llama whose heads vLLM's CPU attention takes at kv_cache_dtype="auto" but refuses under
    fp8 (head_dim 80: not a multiple of 32), 2 layers of 1 KV head (1,280 bytes per token in float32), and a
    rank export of it at p = 0.3."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvfold import api
    from kvfold.plan.recipe import Recipe
    from tests.conftest import VOCAB, tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=160, intermediate_size=320, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    api.calibrate(str(tmp_path / "model"), tmp_path / "calib", tokens=1024, seq_len=128, batch=4)
    api.export(str(tmp_path / "model"), tmp_path / "calib", tmp_path / "rank",
               Recipe(ratio=0.3, multiple=1, eval_tokens=256, passkey=0))
    return tmp_path / "model", tmp_path / "rank"


@pytest.mark.vllm
def test_serve_runs_every_kind_of_configuration(head80, tmp_path, monkeypatch):
    """1 MiB: 6 blocks of 128 tokens of the original, fewer than the 8 × (64 + 128) of the cache-limited workload.
    fp8 refuses head_dim 80 on CPU (runs: false with the engine's own reason); a bfloat16 cache under a float32
    model starts, and the probe finds it read back as float32, or vLLM's worker crashes reading it (runs: false
    either way, measured); the JSON and PNG written. Each engine runs in one process (ENGINE_IN_PROCESS); the paired
    decode runs the two that run in one process, taking turns."""
    pytest.importorskip("matplotlib")
    for name, value in ENGINE_IN_PROCESS.items():
        monkeypatch.setenv(name, value)
    original_dir, export = head80
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = run("serve", "--export", export, "--against", original_dir, "--kv-cache-mib", "1",
                 "--kv-cache-dtype", "fp8", "--kv-cache-dtype", "bfloat16", "--requests", "8",
                 "--prompt-tokens", "64", "--new-tokens", "128", "--long-prompt-tokens", "400",
                 "--long-new-tokens", "8", "--rounds", "2", "--paired-steps", "14",
                 "--eager", "--json", out, "--png", png)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert png.is_file() and report == json.loads(result.stdout)
    configs = report["configurations"]
    assert list(configs) == ["original", "export:rank", "fp8", "bfloat16"]
    original, exported = configs["original"], configs["export:rank"]
    assert original["kv_token_capacity"] == (1 << 20) // (128 * 1280) * 128 == 768
    assert report["workloads"]["cache_limited"]["limits_original"]
    for c in (original, exported):
        assert c["runs"] and c["cache_limited"]["generated_tokens"] == 8 * 128
        assert c["long_context"]["decode_tokens"] == 7 and c["long_context"]["decode_tokens_per_s"] > 0
        keys = c["long_context"]["passkeys"]  # a random tiny model retrieves none; the count is what is checked
        assert keys["prompts"] == 10 and 0 <= keys["retrieved"] <= 10 and 256 < keys["context"] <= 400
        assert c["bytes_per_token"] == round((1 << 20) / c["kv_token_capacity"], 1)
    assert 1 < original["cache_limited"]["peak_running_requests"] < 8
    # 8 × 192 tokens against the original's 6 blocks of 128: the requests it admits (a block each) grow into a
    # second block, and vLLM preempts some of them
    assert original["cache_limited"]["preemptions"] > 0
    assert original["cache_limited"]["preemptions"] >= exported["cache_limited"]["preemptions"] >= 0
    assert exported["kv_token_capacity"] > original["kv_token_capacity"] and exported["capacity_target_met"]
    assert exported["format"] == "rank" and 0 <= exported["probe"]["top1_agreement"] <= 1
    assert not configs["fp8"]["runs"] and "cache_limited" not in configs["fp8"]
    assert "head_size divisible by 32" in configs["fp8"]["reason"]
    half = configs["bfloat16"]
    assert not half["runs"] and "cache_limited" not in half
    # vLLM's CPU kernel reads the 2-byte cache as float32, past the end of its tensor: wrong values (the probe
    # says so) or, depending on what lies beyond, its worker dies (seen 2026-11-25: a segmentation fault, or exit
    # code 0 with the engine cancelled) — each reported as not running, with why
    if "error" in half:
        assert half["reason"].startswith("the engine failed: "), half
    else:
        assert not reads_back(half["probe"]) and half["probe"]["top1_agreement"] < 0.5
        assert "CPU attention declares only auto" in half["reason"]
    # --rounds 2: the configurations that run, again in turn (tokens/s only), each round's ratio and the median
    assert report["rounds"] == 2 and "rounds" not in configs["fp8"] and "rounds" not in half
    for c in (original, exported):
        rounds = c["rounds"]
        assert len(rounds["decode_tokens_per_s"]) == len(rounds["generated_tokens_per_s"]) == 2
        assert rounds["decode_tokens_per_s"][0] == c["long_context"]["decode_tokens_per_s"]
        assert all(x > 0 for x in rounds["decode_tokens_per_s"] + rounds["generated_tokens_per_s"])
    assert original["rounds"]["vs_original"]["decode_tokens_per_s"] == [1.0, 1.0]
    ratios = exported["rounds"]["vs_original"]["decode_tokens_per_s"]
    assert ratios[0] == exported["vs_original"]["decode_tokens_per_s"]
    assert exported["rounds"]["vs_original"]["decode_tokens_per_s_median"] == round(sum(ratios) / 2, 4)
    # --paired-steps 14: the configurations that run, their engines in one process taking turns (two turns of 7)
    paired = report["workloads"]["paired_decode"]
    assert paired["runs"] and paired["context"] == 400 and paired["counted_steps_per_configuration"] == 14
    assert "paired_decode" not in configs["fp8"] and "paired_decode" not in half
    assert original["paired_decode"]["vs_original"] == 1.0
    for c in (original, exported):
        assert c["paired_decode"]["decode_steps"] == 14 and c["paired_decode"]["decode_tokens_per_s"] > 0
        low, high = c["paired_decode"]["vs_original_turn_quartiles"]
        assert 0 < low <= high


def test_a_windowed_export_is_served_without_prefix_caching(tmp_path):
    """The OpenAI server (kvfold-bench ruler, ttft) serves a windowed bits export as its users must: with
    --no-enable-prefix-caching, which the plugin asks for; other models keep vLLM's default."""
    from kvfold_bench.openai_server import _windowed_flags

    (tmp_path / "config.json").write_text(json.dumps({"kvfold": {"format": "bits", "sinks": 16, "window": 64}}))
    assert _windowed_flags(tmp_path) == ["--no-enable-prefix-caching"]
    (tmp_path / "config.json").write_text(json.dumps({"kvfold": {"format": "bits"}}))
    assert _windowed_flags(tmp_path) == [] and _windowed_flags(tmp_path / "missing") == []
