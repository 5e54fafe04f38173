"""Write an exported checkpoint: a normal HF directory + kvfold.json, into a directory the caller
made atomic (kvfold.io.atomic_dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from kvfold.checkpoint.manifest import Manifest
from kvfold.io import atomic_write_text, sha256_file
from kvfold_runtime import MANIFEST, runtime_class_name

__all__ = ["write_checkpoint"]

# Files of the source folder that describe the tokenizer or generation and travel unchanged.
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def write_checkpoint(baked: nn.Module, source: Path, manifest: Manifest, out: Path,
                     max_shard_size: str = "200MB") -> Manifest:
    baked.save_pretrained(out, max_shard_size=max_shard_size)
    # save_pretrained writes the class it was called on as the architecture; name the runtime's class
    # instead, and add a small block that vLLM's and transformers' config objects carry along.
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [runtime_class_name(manifest.source.architecture)]
    config["kvfold"] = manifest.config_block().to_dict()
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _CARRIED:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy2(source / name, out / name)
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    final = manifest.model_copy(update={"files": files})
    atomic_write_text(out / MANIFEST, final.to_json())
    return final
