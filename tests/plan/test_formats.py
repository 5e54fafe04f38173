"""The cache formats (kvfold/plan/formats): one class per format, registered by name, and nothing else in kvfold
branching on a format's name; a format added in a test exports end to end."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.plan.formats import FORMATS, get_format
from kvfold.plan.formats.rank import RankFormat
from kvfold.plan.recipe import Recipe, load_recipe
from tests.conftest import write_tiny_text
from tests.test_cli import assert_user_error, run

KVFOLD = Path(__file__).parents[2] / "kvfold"
# the formats themselves may name formats
_SKIPPED = KVFOLD / "plan" / "formats"
_NAMES = {"bits", "rank"}
_COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _named(node: ast.AST) -> bool:
    """`node` is the string "bits" or "rank", or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(map(_named, node.elts))
    return isinstance(node, ast.Constant) and node.value in _NAMES


def _offences(source: str) -> list[int]:
    """Lines that compare with a format's name (==, !=, in, not in) or key a dict literal by one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, _COMPARISONS) for op in node.ops):
            if any(map(_named, [node.left, *node.comparators])):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and _named(k) for k in node.keys):
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_each_kind_of_format_branch():
    for source in ('x == "bits"', '"rank" != x', 'x in ("rank", "bits")', 'x not in ["bits"]',
                   '{"rank": 1.0, "bits": 32.0}'):
        assert _offences(source) == [1], source
    assert _offences('x.k_bits is None\nf"{x} bits"\nget_format(name)\nd["bits"]') == []


def test_no_module_outside_the_formats_branches_on_a_formats_name():
    found = [f"{path.relative_to(KVFOLD.parent)}:{line}" for path in sorted(KVFOLD.rglob("*.py"))
             if not path.is_relative_to(_SKIPPED)
             for line in _offences(path.read_text())]
    assert not found, "ask the format object (kvfold/plan/formats) instead: " + ", ".join(found)


def test_no_module_of_kvfold_is_over_300_lines():
    long = {str(p.relative_to(KVFOLD.parent)): n for p in KVFOLD.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_each_format_sets_its_defaults_and_refusals():
    rank, bits = get_format("rank"), get_format("bits")
    assert (rank.layout, bits.layout) == ("rank", "bits") and rank.manifest_name is bits.manifest_name is None
    assert Recipe(accuracy=0.9, format="bits").v_scale == bits.v_scale == 32.0
    assert Recipe(accuracy=0.9, multiple=16).rounding == rank.rounding(Recipe(accuracy=0.9, multiple=16)) == (16, 8)
    assert bits.band_scale == "log8" and rank.band_scale is None
    with pytest.raises(KVFoldError, match="--format: Input should be 'rank' or 'bits'"):
        load_recipe(None, {"accuracy": 0.9, "format": "rank4"})


def test_each_formats_frontier_method_is_the_benchmarks():
    methods = pytest.importorskip("kvfold_bench.frontier.methods")
    assert {f.frontier_method for f in FORMATS.values()} <= set(methods.METHODS)


class Rank4Format(RankFormat):
    """A toy format: the rank format with every rank a multiple of 4, whatever --multiple says. It writes the rank
    layout, which the runtime serves as it serves any rank export; its manifest names it (Manifest.format)."""

    name = "rank4"
    summary = "ranks in multiples of 4"
    frontier_method = "kvfold-rank4"

    def rounding(self, recipe):
        return 4, recipe.min_rank


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    text = write_tiny_text(root / "eval.txt")
    calib = root / "calib"
    assert run("calibrate", tiny_dirs["LlamaForCausalLM"], "-o", calib, "--tokens", 512, "--seq-len", 64).exit_code == 0
    return tiny_dirs["LlamaForCausalLM"], calib, text


def _export(setup, out, *extra):
    model, calib, text = setup
    return run("export", model, "--calib", calib, "--eval-text", text, "--eval-tokens", 256, "--margin", 0,
               "-o", out, *extra)


def test_a_format_added_as_a_class_and_a_registry_line_exports_end_to_end(setup, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    import kvfold_runtime
    from kvfold_runtime.export import check_export

    out = tmp_path / "rank4"
    with monkeypatch.context() as patch:
        patch.setitem(FORMATS, Rank4Format.name, Rank4Format())
        result = _export(setup, out, "--accuracy", 0.5, "--format", "rank4", "--multiple", 1)
        assert result.exit_code == 0, result.output
        m = Manifest.load(out)
        assert m.format == "rank4" and json.loads((out / "kvfold.json").read_text())["format"] == "rank4"
        assert m.rounding_multiple == 4 and all(r % 4 == 0 for side in (m.d_k, m.d_v) for row in side for r in row)
        assert m.k_bits is None and m.passkey is not None  # the rank layout; the pass keys checked on its caches
        # a reused curve keeps the format; another format's export may not reuse it
        again = _export(setup, tmp_path / "again", "--accuracy", 0.5, "--format", "rank4", "--reuse-curve", out)
        assert again.exit_code == 0, again.output
        assert Manifest.load(tmp_path / "again").format == "rank4"
        assert_user_error(_export(setup, tmp_path / "x", "--accuracy", 0.5, "--reuse-curve", out),
                          "was searched with a different", tmp_path / "x")
    # the runtime serves it by its layout, knowing nothing of the format
    check_export(out)
    assert kvfold_runtime.ConfigBlock.from_dict(json.loads((out / "config.json").read_text())["kvfold"]).d_k == m.d_k
    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert torch.isfinite(served(input_ids=torch.arange(24)[None]).logits).all()
    # the registration ended with the test
    with pytest.raises(KVFoldError, match="--format: Input should be 'rank' or 'bits'"):
        load_recipe(None, {"accuracy": 0.5, "format": "rank4"})
