"""The calibration artifact: `stats.safetensors` (float64 Grams) + `calib.json` (a versioned header).

Tensor names: `layers.{i}.q` [H, d, d] post-RoPE queries per query head, `layers.{i}.k` [H_kv, d, d]
post-RoPE keys per KV head, `layers.{i}.v` [H_kv, d, d] values per KV head, `layers.{i}.o` [H, d, d]
attention output (o_proj input) per query head. Non-RoPE models: the same at the projection outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvfold.errors import KVFoldError
from kvfold.io import atomic_write_text, sha256_file

__all__ = ["KINDS", "SCHEMA_VERSION", "CalibHeader", "CalibOptions", "CalibStats", "ModelIdentity"]

SCHEMA_VERSION = "1.1"  # 1.1: the keys' mean per layer and head ("layers.i.k_mean"), when the sink had it
HEADER_FILE = "calib.json"
STATS_FILE = "stats.safetensors"
KINDS = ("q", "k", "v", "o")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelIdentity(_Frozen):
    spec: str
    path: str
    architecture: str
    adapter: str
    weights_sha256: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class CalibOptions(_Frozen):
    source: Literal["random", "text"]
    text: str | None
    tokens: int  # requested
    seq_len: int
    batch: int
    prune: float
    kmeans: int | None
    seed: int
    dtype: Literal["float32", "bfloat16", "float16"]


class CalibHeader(_Frozen):
    schema_version: str = SCHEMA_VERSION
    kvfold_version: str
    torch_version: str
    transformers_version: str
    model: ModelIdentity
    options: CalibOptions
    tokens: int  # collected (after pruning)
    sequences: int
    stats_sha256: str = ""


@dataclass(frozen=True)
class CalibStats:
    header: CalibHeader
    grams: dict[str, torch.Tensor]  # float64

    def gram(self, layer: int, kind: str) -> torch.Tensor:
        return self.grams[f"layers.{layer}.{kind}"]

    def key_mean(self, layer: int) -> torch.Tensor | None:
        """[H_kv, d] the keys' mean as calibrated (post-RoPE where the model has RoPE); None: not recorded
        (calibrations before schema 1.1, the k-means sink)."""
        return self.grams.get(f"layers.{layer}.k_mean")

    def save(self, directory: Path) -> None:
        save_file({k: v.contiguous() for k, v in self.grams.items()}, directory / STATS_FILE)
        header = self.header.model_copy(update={"stats_sha256": sha256_file(directory / STATS_FILE)})
        atomic_write_text(directory / HEADER_FILE, json.dumps(header.model_dump(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, directory: Path) -> CalibStats:
        directory = Path(directory)
        hint = "re-run kvfold calibrate"
        if not (directory / HEADER_FILE).is_file():
            raise KVFoldError(f"'{directory}' is not a calibration directory (no {HEADER_FILE}); {hint}")
        try:
            raw = json.loads((directory / HEADER_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise KVFoldError(f"{directory / HEADER_FILE} is corrupted ({e}); {hint}") from None
        major = str(raw.get("schema_version", "")).split(".")[0]
        if major != SCHEMA_VERSION.split(".")[0]:
            raise KVFoldError(f"calibration schema {raw.get('schema_version')!r} is not supported by this "
                              f"kvfold (reads {SCHEMA_VERSION}); {hint}")
        try:
            header = CalibHeader.model_validate(raw)
        except ValidationError as e:
            raise KVFoldError(f"{directory / HEADER_FILE} is invalid ({e.error_count()} errors); {hint}") from None
        stats = directory / STATS_FILE
        if not stats.is_file() or sha256_file(stats) != header.stats_sha256:
            raise KVFoldError(f"{stats} is missing or corrupted (sha256 mismatch); {hint}")
        try:
            grams = load_file(stats)
        except (SafetensorError, OSError) as e:
            raise KVFoldError(f"{stats} cannot be read ({e}); {hint}") from None
        return cls(header=header, grams=grams)
