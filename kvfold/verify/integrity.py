"""Integrity of an exported directory, before anything is loaded: the manifest, the sha256 of every
file, config.json against the manifest, and the shape of every tensor against the ranks the manifest
states (expected shapes come from the runtime's own model class, built on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.io import sha256_file
from kvfold.verify.report import Check
from kvfold.verify.runtime import require_runtime
from kvfold_runtime import MANIFEST, ConfigBlock, runtime_class_name, tensor_shapes

__all__ = ["integrity_checks"]

_LOADED = (".safetensors", ".json")  # files a loader would read: none may be unlisted


def _files(directory: Path, m: Manifest) -> Check:
    problems = []
    for name, sha in sorted(m.files.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != sha:
            problems.append(f"{name} differs from the manifest (sha256)")
    extra = sorted(p.name for p in directory.iterdir()
                   if p.is_file() and p.name.endswith(_LOADED) and p.name not in m.files and p.name != MANIFEST)
    problems += [f"{name} is not listed in the manifest" for name in extra]
    return Check("files", not problems, "; ".join(problems) or f"{len(m.files)} files match their sha256")


def _config(directory: Path, m: Manifest) -> tuple[Check, dict | None]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return Check("config", False, f"config.json unreadable ({e.__class__.__name__})"), None
    problems = []
    if config.get("architectures") != [runtime_class_name(m.source.architecture)]:
        problems.append(f"architectures is {config.get('architectures')}, expected "
                        f"[{runtime_class_name(m.source.architecture)}]")
    try:
        block, ours = ConfigBlock.from_dict(config.get("kvfold")), m.config_block()
    except ValueError as e:
        return Check("config", False, str(e)), config
    if (block.d_k, block.d_v) != (ours.d_k, ours.d_v):
        problems.append("the kvfold block's d_k/d_v differ from the manifest's")
    if (block.k_bits, block.v_bits, block.band_scale) != (ours.k_bits, ours.v_bits, ours.band_scale):
        problems.append("the kvfold block's bit widths differ from the manifest's")
    return Check("config", not problems, "; ".join(problems) or "config.json agrees with the manifest"), config


def _expected_shapes(directory: Path, m: Manifest) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Tensor shapes the runtime's class has at the manifest's ranks, and the names tied to others."""
    from transformers import AutoConfig, AutoModelForCausalLM

    require_runtime()

    config = AutoConfig.from_pretrained(directory)
    config.kvfold = m.config_block().to_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied


def _shapes(directory: Path, m: Manifest) -> Check:
    try:
        expected, tied = _expected_shapes(directory, m)
    except ValueError as e:  # the manifest's ranks do not fit the model (e.g. a layer or head missing)
        return Check("shapes", False, str(e))
    found = tensor_shapes(directory)
    problems = [f"{k} is missing" for k in sorted(set(expected) - set(found) - tied)]
    problems += [f"{k} is unexpected" for k in sorted(set(found) - set(expected))]
    problems += [f"{k} has shape {list(found[k])}, the manifest's ranks give {list(s)}"
                 for k, s in sorted(expected.items()) if k in found and found[k] != s]
    problems += [f"extra tensor {k} is missing" for k in m.extra_tensors if k not in found]
    detail = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return Check("shapes", not problems, detail or f"{len(found)} tensors have the shapes of the manifest's ranks")


def integrity_checks(directory: Path) -> tuple[Manifest | None, list[Check]]:
    """(manifest or None when unreadable, checks). KVFoldError only when this is no kvfold export."""
    if not (directory / MANIFEST).is_file():
        raise KVFoldError(f"'{directory}' is not a kvfold export (no {MANIFEST}); run kvfold export first")
    try:
        m = Manifest.load(directory)
    except KVFoldError as e:
        return None, [Check("manifest", False, str(e))]
    checks = [Check("manifest", True, f"schema {m.schema_version}, {m.source.architecture}, method {m.method}"),
              _files(directory, m)]
    config_check, config = _config(directory, m)
    checks.append(config_check)
    if config is not None:
        checks.append(_shapes(directory, m))
    return m, checks
