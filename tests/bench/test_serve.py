"""`kvfold bench serve|openai` refuse bad input before starting any engine (the vLLM runs themselves are
in tests/runtime/test_vllm.py)."""

import pytest
from typer.testing import CliRunner

from kvfold.cli import app


@pytest.mark.parametrize("args", [
    ["bench", "serve", "--export", "{tmp}"],
    ["bench", "serve", "--export", "{tmp}", "--requests", "0"],
    ["bench", "serve", "--export", "{tmp}", "--kv-cache-mib", "0"],
    ["bench", "openai", "--export", "{tmp}"],
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args):
    args = [a.format(tmp=tmp_path) for a in args]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "rror" in lines[0] and "Traceback" not in result.output
