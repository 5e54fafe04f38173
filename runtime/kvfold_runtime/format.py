"""The checkpoint contract between `kvfold export` and every runtime, defined once (docs/format.md says it for
humans). kvfold writes exports through these names; the transformers and vLLM runtimes, the kernels and the
export check read them from here.

An export folder is a HF checkpoint plus `kvfold.json` (MANIFEST: the sha256 of every file, how the export
was made). Its config.json names the runtime class (`KVFold<Arch>`, `runtime_class_name`) in `architectures`
and carries a `kvfold` block (`ConfigBlock`): the schema version, per layer and KV head the kept key and value
widths d_k / d_v, whether the attention modules hold post-RoPE projections (tensors `<attn>.kvfold_q_post`
[d, Σ_h d_k(g(h))] and `<attn>.kvfold_k_post` [d, Σ_g d_k], Q_POST / K_POST), whether they also hold a key
shift (`<attn>.kvfold_k_shift` [H_kv · d], K_SHIFT, subtracted from the post-RoPE keys before K_POST), and for
the bits format the bit width of every kept dim (k_bits / v_bits) and the bands' scale format (band_scale), and for
a windowed bits export how many first tokens (`sinks`) and last tokens (`window`) every layer also keeps at the
model's dtype (schema 1.10; absent: 0, none).

Why a window: the attention sinks and the most recent tokens take most of a query's attention, so their rounding
costs more than any other tokens'; a query reads them whole and the rest from their codes (kernels/torch_window.py,
docs/format.md). Bytes per token then depend on the context: every token's codes plus sinks + window whole rows.

Why a key shift: every query's scores move by the same constant (q · shift) when a constant is subtracted from
every key, and softmax does not see it, so attention is unchanged — but the stored keys lose their mean. Models
with key biases (Qwen2) have post-RoPE keys dominated by one direction shared by every token; rounding k' to the
model's dtype, or to a band's codes whose scale that direction sets, then costs far more than the keys' spread
warrants (docs/notebook.md: Qwen2.5-Coder's bits export at 0.99).

Packed layouts, used everywhere (heads in order, each at its own width, no padding):
  queries [..., Σ_h d_k(g(h))]   keys [..., Σ_g d_k[g]]   values [..., Σ_g d_v[g]]
  attention output (input of o_proj) [..., Σ_h d_v(g(h))]
where query head h belongs to KV head g(h) = h // group. A cached token's row is [keys | values]: in the
model's dtype (rank format), or per head its bands' codes then scales (bits format, kvfold_runtime.bands).
`LayerDims.row_bytes` is what one token costs in one layer's cache, in both formats.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvfold_runtime.bands import LEGACY_SCALE, Band, bands_from_bits, row_bytes

__all__ = ["K_POST", "K_SHIFT", "MANIFEST", "Q_POST", "SCHEMA_VERSION", "ConfigBlock", "LayerDims", "check_schema",
           "head_dim", "model_dims", "runtime_class_name"]

MANIFEST = "kvfold.json"
# The version kvfold writes (history: kvfold/checkpoint/manifest.py). A runtime reads every minor version of
# its major: minor versions only add fields with defaults that keep older exports' meaning.
SCHEMA_VERSION = "1.10"
SCHEMA_MAJOR = SCHEMA_VERSION.split(".")[0]
Q_POST, K_POST = "kvfold_q_post", "kvfold_k_post"  # post-RoPE projections, parameters of each attention module
K_SHIFT = "kvfold_k_shift"  # the constant subtracted from post-RoPE keys (schema 1.8; absent: none)


def runtime_class_name(architecture: str) -> str:
    """The class serving exports of `architecture` (a source HF class, e.g. LlamaForCausalLM ->
    KVFoldLlamaForCausalLM): what config.json's `architectures` names."""
    return f"KVFold{architecture}"


def check_schema(version, where: str = "") -> None:
    """ValueError (with the fix) unless `version` is of the schema major this runtime reads."""
    if str(version or "").split(".")[0] != SCHEMA_MAJOR:
        raise ValueError(f"{where}kvfold schema version {version!r} is not {SCHEMA_MAJOR}.x; upgrade kvfold-runtime "
                         "(or kvfold) or re-export the model")


def head_dim(config) -> int:
    """A head's width: config.head_dim where the architecture sets it (Gemma, Qwen3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class LayerDims:
    """One layer's widths and cache row."""

    d_k: tuple[int, ...]  # per KV head
    d_v: tuple[int, ...]
    group: int  # query heads per KV head
    k_bands: tuple[tuple[Band, ...], ...] = ()  # per KV head, for a bits-format export; () = stored as is
    v_bands: tuple[tuple[Band, ...], ...] = ()

    def __hash__(self) -> int:
        # hashed by every kernel launch's caches (page_layout, its tables): the nested band tuples hashed once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.d_k, self.d_v, self.group, self.k_bands, self.v_bands))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # a str's hash differs between processes (a Band's scale): the cached hash never travels in a pickle
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def banded(self) -> bool:
        return bool(self.k_bands)

    @property
    def num_kv_heads(self) -> int:
        return len(self.d_k)

    @property
    def q_width(self) -> int:
        return self.group * sum(self.d_k)

    @property
    def out_width(self) -> int:
        return self.group * sum(self.d_v)

    @property
    def k_offsets(self) -> tuple[int, ...]:
        """Each KV head's first column in the packed keys."""
        return tuple(itertools.accumulate(self.d_k, initial=0))[:-1]

    @property
    def v_offsets(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.d_v, initial=0))[:-1]

    def row_bytes(self, element_size: int = 2) -> tuple[int, int]:
        """Cached bytes per token: (keys, values). Rank format: the widths in the cache's dtype (`element_size`
        bytes a number); bits format: every head's band codes and scales, whatever the model's dtype."""
        if self.banded:
            return sum(map(row_bytes, self.k_bands)), sum(map(row_bytes, self.v_bands))
        return sum(self.d_k) * element_size, sum(self.d_v) * element_size


@dataclass(frozen=True)
class ConfigBlock:
    """config.json's `kvfold` block: what a runtime needs to build the model and its cache."""

    d_k: list[list[int]]  # [layer][kv head]
    d_v: list[list[int]]
    post_rope_projections: bool
    k_bits: list[list[list[int]]] | None = None  # bits format: [layer][kv head][kept dim], non-increasing
    v_bits: list[list[list[int]]] | None = None
    band_scale: str = LEGACY_SCALE  # bits format: the bands' scale format (absent before schema 1.6: float16)
    schema_version: str = SCHEMA_VERSION
    key_shift: bool = False  # the attention modules hold K_SHIFT (schema 1.8; absent: False)
    sinks: int = 0  # bits format: first tokens also kept whole (schema 1.10; absent: 0)
    window: int = 0  # bits format: last tokens also kept whole (schema 1.10; absent: 0)

    def to_dict(self) -> dict:
        block = {"schema_version": self.schema_version, "d_k": self.d_k, "d_v": self.d_v,
                 "post_rope_projections": self.post_rope_projections}
        if self.k_bits is not None:
            block |= {"k_bits": self.k_bits, "v_bits": self.v_bits, "band_scale": self.band_scale}
        if self.key_shift:
            block["key_shift"] = True
        if self.windowed:
            block |= {"sinks": self.sinks, "window": self.window}
        return block

    @classmethod
    def from_dict(cls, block) -> ConfigBlock:
        """ValueError (with the fix) when `block` is not a kvfold block of a schema this runtime reads."""
        if not isinstance(block, dict) or "d_k" not in block or "d_v" not in block:
            raise ValueError("config.json has no 'kvfold' block: this is not a kvfold export (run kvfold export)")
        check_schema(block.get("schema_version"))
        bits = "k_bits" in block
        return cls(block["d_k"], block["d_v"], bool(block.get("post_rope_projections", False)),
                   block["k_bits"] if bits else None, block["v_bits"] if bits else None,
                   block.get("band_scale", LEGACY_SCALE), str(block["schema_version"]),
                   bool(block.get("key_shift", False)), *_window(block, bits))

    @classmethod
    def from_config(cls, config) -> ConfigBlock:
        """The block of a transformers or vLLM config object (it carries config.json's keys as attributes)."""
        return cls.from_dict(getattr(config, "kvfold", None))

    @property
    def format(self) -> str:
        return "rank" if self.k_bits is None else "bits"

    @property
    def windowed(self) -> bool:
        """Some tokens are also kept whole (a windowed bits export)."""
        return bool(self.sinks or self.window)

    def layers(self, num_heads: int, num_kv_heads: int, num_layers: int | None = None) -> list[LayerDims]:
        """Every layer's widths; ValueError (with the fix) when they do not fit the model's head counts."""
        layers = []
        for i, (d_k, d_v) in enumerate(zip(self.d_k, self.d_v, strict=True)):
            if len(d_k) != num_kv_heads or len(d_v) != num_kv_heads:
                raise ValueError(f"config.json kvfold block: layer {i} lists {len(d_k)}/{len(d_v)} heads, "
                                 f"the model has {num_kv_heads} KV heads; re-export the model")
            layers.append(LayerDims(tuple(d_k), tuple(d_v), num_heads // num_kv_heads, *self._bands(i)))
        if num_layers is not None and len(layers) != num_layers:
            raise ValueError(f"config.json kvfold block lists {len(layers)} layers, the model has {num_layers}; "
                             "re-export the model")
        return layers

    def _bands(self, layer: int) -> tuple:
        """Layer `layer`'s key and value bands of a bits-format export (() for both otherwise)."""
        if self.k_bits is None:
            return (), ()
        out = []
        for side, heads, widths in (("k_bits", self.k_bits[layer], self.d_k[layer]),
                                    ("v_bits", self.v_bits[layer], self.d_v[layer])):
            if [sum(b > 0 for b in h) for h in heads] != list(widths):
                raise ValueError(f"config.json kvfold block: layer {layer}'s {side} do not match its ranks; "
                                 "re-export the model")
            out.append(tuple(bands_from_bits(list(h), self.band_scale) for h in heads))
        return tuple(out)

    def bytes_per_token(self, element_size: int = 2, context: int | None = None) -> float:
        """Cached bytes per token over every layer, keys and values (element_size: see LayerDims.row_bytes; for a
        windowed export also the bytes of a whole row). A windowed export holds every token's codes, its first
        `sinks` tokens' whole rows and its last `window` ones' (a token can be both while the context is shorter
        than sinks + window), so its bytes per token depend on the `context` (required then)."""
        coded = sum(sum(LayerDims(tuple(k), tuple(v), 1, *self._bands(i)).row_bytes(element_size))
                    for i, (k, v) in enumerate(zip(self.d_k, self.d_v, strict=True)))
        if not self.windowed:
            return coded
        if context is None:
            raise ValueError("a windowed export's bytes per token depend on the context: give one")
        whole = sum(sum(k) + sum(v) for k, v in zip(self.d_k, self.d_v, strict=True)) * element_size
        return coded + whole * (min(context, self.sinks) + min(context, self.window)) / context


def _window(block: dict, bits: bool) -> tuple[int, int]:
    """(sinks, window) of a config block; ValueError (with the fix) when they are not counts of a bits export."""
    sinks, window = block.get("sinks", 0), block.get("window", 0)
    if not all(isinstance(n, int) and n >= 0 for n in (sinks, window)) or (not bits and (sinks or window)):
        raise ValueError(f"config.json kvfold block: sinks {sinks!r} and window {window!r} must be counts of tokens "
                         "of a bits-format export; re-export the model")
    return sinks, window


def model_dims(config) -> list[LayerDims]:
    """The widths of every layer of an export's config; ValueError (with the fix) when config.json is not a
    kvfold export's of this model."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ConfigBlock.from_config(config).layers(heads, kv_heads, config.num_hidden_layers)
