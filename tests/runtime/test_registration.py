"""kvfold_runtime registers with transformers through public API only, on the oldest and the newest
transformers that runtime/pyproject.toml declares: the venv's (5.19) in this process, 5.17 in a
subprocess that puts the folder scripts/setup.sh installs it into first on PYTHONPATH."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvfold_runtime
from kvfold_runtime.hf import models
from tests.conftest import TINY_CONFIGS

OLDEST = "5.17.0"  # the oldest transformers runtime/pyproject.toml allows; scripts/setup.sh installs it
OLDEST_DIR = Path(os.environ.get("KVFOLD_CACHE", Path.home() / ".cache" / "kvfold")) / f"transformers-{OLDEST}"
ARCHS = sorted(TINY_CONFIGS)
RUNTIME = Path(kvfold_runtime.__file__).parent


def _load(cases: list[list[str]]) -> dict:
    """Load each [architecture, config class, export folder, plain folder] with AutoModelForCausalLM, as a
    user would; return the classes it got and the export's float32 logits. Self-contained: it also runs,
    as source, in a subprocess with another transformers."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    import kvfold_runtime

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    ids = torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(7))
    result = {"version": transformers.__version__, "file": transformers.__file__, "archs": {}}
    for rounds in range(2):  # the second round after a second register(): it is idempotent
        for arch, config_class, export, plain in cases:
            plain_config = AutoConfig.from_pretrained(plain)
            with torch.inference_mode():
                logits = load(export)(input_ids=ids).logits
            result["archs"][arch, rounds] = {
                "export": type(load(export)).__name__, "plain": type(load(plain)).__name__,
                "plain_config": f"{type(plain_config).__module__}.{type(plain_config).__name__}",
                "want_plain_config": f"{getattr(transformers, config_class).__module__}.{config_class}",
                "logits": logits}
        kvfold_runtime.register()
    result["from_config"] = type(AutoModelForCausalLM.from_config(
        LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32))).__name__
    return result


def _cases(tiny_exports, tiny_dirs) -> list[list[str]]:
    return [[arch, models.FAMILIES[arch].config, str(tiny_exports[arch, "uneven"].path), str(tiny_dirs[arch])]
            for arch in ARCHS]


def _check(result: dict) -> None:
    for arch in ARCHS:
        for rounds in range(2):
            got = result["archs"][arch, rounds]
            assert got["export"] == kvfold_runtime.runtime_class_name(arch)
            assert got["plain"] == arch
            assert got["plain_config"] == got["want_plain_config"]  # plain checkpoints: transformers' own class
    assert result["from_config"] == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def newest(tiny_exports, tiny_dirs) -> dict:
    return _load(_cases(tiny_exports, tiny_dirs))


def test_the_venvs_transformers_loads_exports_as_kvfold_classes(newest):
    _check(newest)


def test_the_oldest_declared_transformers_loads_them_alike(tiny_exports, tiny_dirs, tmp_path, newest):
    if not (OLDEST_DIR / "transformers").is_dir():
        pytest.skip(f"transformers {OLDEST} is not installed in {OLDEST_DIR}: run scripts/setup.sh")
    out = tmp_path / "oldest.pt"
    script = (textwrap.dedent(inspect.getsource(_load)) +
              "\nimport json, sys, torch\ntorch.save(_load(json.loads(sys.argv[1])), sys.argv[2])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST_DIR), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(_cases(tiny_exports, tiny_dirs)), str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    oldest = torch.load(out)
    assert oldest["version"].startswith("5.17") and Path(oldest["file"]).is_relative_to(OLDEST_DIR), oldest["version"]
    _check(oldest)
    for arch in ARCHS:
        got, want = oldest["archs"][arch, 0]["logits"], newest["archs"][arch, 0]["logits"]
        assert float((got - want).norm() / want.norm()) < 1e-5, arch


def test_registration_uses_no_private_transformers_attribute():
    """Private attributes of transformers change without notice (`AutoModelForCausalLM._model_mapping`
    did). Allowed: `_from_config`, the hook transformers' Auto classes call on a registered class."""
    source = (RUNTIME / "hf" / "models.py").read_text()
    tree = ast.parse(source)
    private = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith("_") and not node.attr.endswith("__")}
    assert private <= {"_from_config"}, private
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            assert not any(part.startswith("_") for part in node.module.split(".")), node.module
            assert not any(a.name.startswith("_") for a in node.names), [a.name for a in node.names]
    for path in RUNTIME.rglob("*.py"):
        text = path.read_text()
        assert "_model_mapping" not in text and "_extra_content" not in text, path
