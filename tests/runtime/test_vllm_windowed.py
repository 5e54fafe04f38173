"""A windowed bits export (issue 51) in a real vLLM engine: each request's sinks and last `window` tokens whole in
rings beside the layers' code pages (kvfold_runtime.vllm.ring), the transformers runtime's greedy tokens, the rings
packed so that the code blocks keep their count. SmolLM2's windowed run is in test_vllm.py (beside its exports)."""

import pytest

from tests.runtime.test_vllm import BUDGET, _prompts, _tampered, _windowed, first_divergence, hf_greedy, page_bytes
from tests.runtime.vllm_engine import run_engine

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("arch", ["LlamaForCausalLM"])  # the rings do not depend on the family (~25 s an engine)
def test_windowed_export_generates_what_transformers_generates(tiny_bits_exports, tmp_path, arch):
    """A windowed bits export (2 sinks and the last 8 tokens whole, the rest from their codes) in vLLM: each request's
    whole rows in its ring beside the code pages (kvfold_runtime.vllm.ring), prompts of 4–29 tokens then 40 decodes
    and a prefill chunked past the window (max_num_batched_tokens 16), the transformers runtime's greedy tokens; the
    rings fit in pool blocks of 64 tokens (10 float32 rows against 64 code rows), so the blocks keep their count. The
    plain bits export generates other tokens (the codes are coarse), so the rings are what serve the window."""
    path = tmp_path / "w"
    _tampered(tiny_bits_exports[arch].path, path, lambda f: _windowed(f, sinks=2, window=8))
    prompts = _prompts()
    chunked = {"enable_prefix_caching": False, "max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    got = run_engine(path, prompts, max_tokens=40, kv_cache_bytes=BUDGET, block_size=64, engine_args=chunked)
    assert "error" not in got, got["error"]
    want = hf_greedy(path, prompts, 40)
    for p, g, w in zip(prompts, got["tokens"], want, strict=True):
        assert g == w, f"prompt of {len(p)} tokens: first divergence at {first_divergence(g, w)}"
    assert got["kv_blocks"] == BUDGET // page_bytes(path, 64)
    assert want != hf_greedy(tiny_bits_exports[arch].path, prompts, 40)


def test_ring_modules_each_fit_one_pool_block():
    """vllm/ring.py's packing: every layer has a slot, all ring modules share one page (vLLM's grouping wants equal
    ring pages), and a page fits in one pool block (block_size × the code bytes of every layer) unless one layer's
    ring alone is larger, when each module holds one."""
    from kvfold_runtime.format import LayerDims
    from kvfold_runtime.vllm.ring import ring_plan

    dims = [LayerDims((64, 48, 40), (56, 64, 32), 3, *_bands(i)) for i in range(30)]
    code = sum(sum(d.row_bytes()) for d in dims)
    for block_size, element_size, window in [(128, 2, 64), (128, 4, 64), (16, 4, 64), (128, 2, 4000)]:
        plan = ring_plan(dims, 16, window, element_size, block_size)
        page = plan.slots * plan.capacity * plan.width * element_size
        assert plan.width == 304 and plan.rings * plan.slots >= 30 > (plan.rings - 1) * plan.slots
        assert page <= block_size * code or plan.slots == 1
        assert plan.slots == 1 or page + plan.capacity * plan.width * element_size > block_size * code
    plan = ring_plan(dims, 16, 64, 2, 128)
    assert plan.slots > 1 and plan.place(29) == (f"kvfold_rings.{29 // plan.slots}", 29 % plan.slots)


def _bands(seed: int):
    from kvfold_runtime.bands import bands_from_bits

    widths = [(3, 2, 1)[(seed + h) % 3] * 2 for h in range(3)]
    return (tuple(bands_from_bits([widths[h]] * w, "log8") for h, w in enumerate((64, 48, 40))),
            tuple(bands_from_bits([widths[h]] * w, "log8") for h, w in enumerate((56, 64, 32))))
