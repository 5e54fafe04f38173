"""`kvfold-bench serve|openai` refuse bad input before starting any engine (the vLLM runs themselves are
in tests/runtime/test_vllm.py)."""

import pytest
from typer.testing import CliRunner

from kvfold.bench.cli import app


@pytest.mark.parametrize("args", [
    ["serve", "--export", "{tmp}"],
    ["serve", "--export", "{tmp}", "--requests", "0"],
    ["serve", "--export", "{tmp}", "--kv-cache-mib", "0"],
    ["openai", "--export", "{tmp}"],
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args):
    args = [a.format(tmp=tmp_path) for a in args]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "rror" in lines[0] and "Traceback" not in result.output


def test_layout_capacities_follow_vllms_page_formula():
    from types import SimpleNamespace

    from kvfold.bench.serve import layout_capacities

    m = SimpleNamespace(d_k=[[3, 5], [4, 4]], d_v=[[2, 2], [1, 6]])  # two layers, two KV heads each
    got = layout_capacities(m, budget=10_000, block_size=4, dtype="float32")
    # numbers per token: packed 3+5+2+2 + 4+4+1+6 = 27; padded 2·(5+2) + 2·(4+6) = 34
    assert got["packed"]["page_bytes"] == got["buckets"]["page_bytes"] == 4 * 27 * 4
    assert got["pad_to_layer_max"]["page_bytes"] == 4 * 34 * 4
    assert got["packed"]["kv_token_capacity"] == 10_000 // (4 * 27 * 4) * 4 == 92  # blocks × block size
    assert got["pad_to_layer_max"]["kv_token_capacity"] == 10_000 // (4 * 34 * 4) * 4 == 72
    assert got["buckets"]["attention_calls_per_step"] == 4 and got["packed"]["attention_calls_per_step"] == 2
