"""Per-layer, per-KV-head widths of an exported model, read from the `kvfold` block of config.json.

Packed layouts used everywhere in the runtime (heads in order, each at its own width, no padding):
  queries [..., Σ_h d_k(g(h))]   keys [..., Σ_g d_k[g]]   values [..., Σ_g d_v[g]]
  attention output (input of o_proj) [..., Σ_h d_v(g(h))]
where query head h belongs to KV head g(h) = h // group. A cached token's row is [keys | values] in
these layouts: in the transformers cache as two tensors, in vLLM's paged cache as one row of
Σd_k + Σd_v numbers per slot (kvfold_runtime.kernels.paged). Kernels, the vLLM backend and the
transformers path all read these layouts; none pads a head.

A bits-format export (config `kvfold.k_bits` / `v_bits`: per layer, per KV head, the bit width of each
kept dim; `kvfold.band_scale`: the bands' scale format, float16 when absent) stores each head's dims in bit
bands instead (kvfold_runtime.bands): the transformers cache then holds per token [Σ_g row_bytes] uint8 for
keys and for values. Only the transformers runtime reads it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfold_runtime.bands import Band, bands_from_bits, row_bytes

__all__ = ["SUPPORTED_SCHEMA_MAJOR", "LayerDims", "model_dims"]

SUPPORTED_SCHEMA_MAJOR = "1"


@dataclass(frozen=True)
class LayerDims:
    d_k: tuple[int, ...]  # per KV head
    d_v: tuple[int, ...]
    group: int  # query heads per KV head
    k_bands: tuple[tuple[Band, ...], ...] = ()  # per KV head, for a bits-format export; () = stored as is
    v_bands: tuple[tuple[Band, ...], ...] = ()

    @property
    def banded(self) -> bool:
        return bool(self.k_bands)

    def row_bytes(self) -> tuple[int, int]:
        """Cached bytes per token of a bits-format layer: (keys, values)."""
        return sum(map(row_bytes, self.k_bands)), sum(map(row_bytes, self.v_bands))

    @property
    def num_kv_heads(self) -> int:
        return len(self.d_k)

    @property
    def q_width(self) -> int:
        return self.group * sum(self.d_k)

    @property
    def out_width(self) -> int:
        return self.group * sum(self.d_v)


def model_dims(config) -> list[LayerDims]:
    """The widths of every layer; ValueError (with the fix) when config.json is not a kvfold export's."""
    block = getattr(config, "kvfold", None)
    if not isinstance(block, dict) or "d_k" not in block or "d_v" not in block:
        raise ValueError("config.json has no 'kvfold' block: this is not a kvfold export (run kvfold export)")
    version = str(block.get("schema_version", ""))
    if version.split(".")[0] != SUPPORTED_SCHEMA_MAJOR:
        raise ValueError(f"kvfold schema version {version!r} is not {SUPPORTED_SCHEMA_MAJOR}.x; "
                         "upgrade kvfold-runtime or re-export the model")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = []
    for i, (d_k, d_v) in enumerate(zip(block["d_k"], block["d_v"], strict=True)):
        if len(d_k) != kv_heads or len(d_v) != kv_heads:
            raise ValueError(f"config.json kvfold block: layer {i} lists {len(d_k)}/{len(d_v)} heads, "
                             f"the model has {kv_heads} KV heads; re-export the model")
        layers.append(LayerDims(tuple(d_k), tuple(d_v), heads // kv_heads, *_bands(block, i, d_k, d_v)))
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"config.json kvfold block lists {len(layers)} layers, the model has "
                         f"{config.num_hidden_layers}; re-export the model")
    return layers


def _bands(block: dict, layer: int, d_k: list[int], d_v: list[int]) -> tuple:
    """Layer `layer`'s key and value bands of a bits-format export (() for both otherwise)."""
    if "k_bits" not in block:
        return (), ()
    scale = block.get("band_scale", "float16")  # exports before schema 1.6 stored float16 scales
    out = []
    for side, widths in (("k_bits", d_k), ("v_bits", d_v)):
        heads = block[side][layer]
        if [sum(b > 0 for b in h) for h in heads] != list(widths):
            raise ValueError(f"config.json kvfold block: layer {layer}'s {side} do not match its ranks; "
                             "re-export the model")
        out.append(tuple(bands_from_bits(list(h), scale) for h in heads))
    return tuple(out)
