"""Per-layer, per-KV-head widths of an exported model, read from the `kvfold` block of config.json.

Packed layouts used everywhere in the runtime (heads in order, each at its own width, no padding):
  queries [..., Σ_h d_k(g(h))]   keys [..., Σ_g d_k[g]]   values [..., Σ_g d_v[g]]
  attention output (input of o_proj) [..., Σ_h d_v(g(h))]
where query head h belongs to KV head g(h) = h // group. A cached token's row is [keys | values] in
these layouts: in the transformers cache as two tensors, in vLLM's paged cache as one row of
Σd_k + Σd_v numbers per slot (kvfold_runtime.kernels.paged). Kernels, the vLLM backend and the
transformers path all read these layouts; none pads a head.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUPPORTED_SCHEMA_MAJOR", "LayerDims", "model_dims"]

SUPPORTED_SCHEMA_MAJOR = "1"


@dataclass(frozen=True)
class LayerDims:
    d_k: tuple[int, ...]  # per KV head
    d_v: tuple[int, ...]
    group: int  # query heads per KV head

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
        layers.append(LayerDims(tuple(d_k), tuple(d_v), heads // kv_heads))
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"config.json kvfold block lists {len(layers)} layers, the model has "
                         f"{config.num_hidden_layers}; re-export the model")
    return layers
