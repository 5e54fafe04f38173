"""The bits format's plan and the rule that makes it (plan/bits.py allocates): every rotated dim's bit width, the
bands' scale format and a windowed plan's whole tokens; what the cache costs per token."""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.plan.formats.bits import ALIGN
from kvfold.plan.ranks import RankPlan
from kvfold_runtime import BAND_WIDTHS, DEFAULT_BAND_SCALE, ConfigBlock, bands_from_bits

__all__ = ["SCALE", "WINDOW_CONTEXT", "BitPlan", "BitRule", "fp16_bytes_per_token"]

# The bands' per-token scale format (BAND_SCALES), charged in the allocation at its bits: the runtime's default,
# log8 (one byte, steps of 2^(1/8)). Against float16, measured on SmolLM2 (2026-11-25, 6,132 wiki:eval tokens, same
# V_SCALE): float16 scales at 0.297 of fp16's bytes gave KL 0.057, log8 at 0.2775 gave KL 0.043.
SCALE = DEFAULT_BAND_SCALE
KEY_MIN_BITS = 4  # keys' narrowest width by default (BitRule.key_min; why 4: plan/bits.py)
WINDOW_CONTEXT = 4096  # the context a windowed plan's bytes (and its compression p) are stated at (BitPlan)


def fp16_bytes_per_token(head_dim: int, kv_heads: int) -> int:
    """The same cache in float16, the figure every compression is stated against: 2 bytes per number, keys and
    values, head_dim numbers per KV head (kv_heads: over every layer)."""
    return 2 * 2 * head_dim * kv_heads


@dataclass(frozen=True)
class BitRule:
    theta_k: float  # distortion-per-bit multiplier for keys
    theta_v: float
    widths: tuple[int, ...] = BAND_WIDTHS  # allowed band widths
    layer_k: tuple[float, ...] = ()  # per-layer multipliers of theta; () = all 1
    layer_v: tuple[float, ...] = ()
    scale: str = SCALE  # the bands' scale format (kvfold_runtime.bands.SCALES)
    # per layer and KV head, multipliers of theta on top of the layer's (the sensitivity allocation,
    # plan/rounding.py); () = all 1
    head_k: tuple[tuple[float, ...], ...] = ()
    head_v: tuple[tuple[float, ...], ...] = ()
    align: int = ALIGN  # every band starts and ends on a multiple of this many dims (dim_bits); 1: anywhere
    sinks: int = 0  # the first tokens also kept whole (a windowed export, issue 51; BitPlan)
    window: int = 0  # the last tokens also kept whole
    key_min: int = KEY_MIN_BITS  # keys are never dropped nor stored below this many bits

    @property
    def r_k(self) -> float:  # the search's knob, recorded in the curve as r_k / r_v (plan/search.py)
        return self.theta_k

    @property
    def r_v(self) -> float:
        return self.theta_v

    def thetas(self, layer: int) -> tuple[float, float]:
        wk = self.layer_k[layer] if self.layer_k else 1.0
        wv = self.layer_v[layer] if self.layer_v else 1.0
        return self.theta_k * wk, self.theta_v * wv

    def head_thetas(self, layer: int, heads: int) -> tuple[list[float], list[float]]:
        """Each KV head's θ_k and θ_v in `layer`."""
        tk, tv = self.thetas(layer)
        wk = self.head_k[layer] if self.head_k else (1.0,) * heads
        wv = self.head_v[layer] if self.head_v else (1.0,) * heads
        return [tk * w for w in wk], [tv * w for w in wv]


@dataclass(frozen=True)
class BitPlan:
    k_bits: list[list[list[int]]]  # [layer][kv head][dim], non-increasing along dims; 0 = dropped
    v_bits: list[list[list[int]]]
    head_dim: int
    scale: str = SCALE  # the bands' scale format (kvfold_runtime.bands.SCALES)
    # A windowed plan (issue 51) also keeps every layer's first `sinks` and last `window` tokens whole (2 bytes a
    # number, as fp16's): a query reads them whole and every other token from its codes (kvfold.hooks.AttentionPatch
    # .exact, kvfold_runtime's torch_window). Its bytes per token then depend on the context; they are stated at
    # WINDOW_CONTEXT tokens (the pass-key check's; export's summary also gives them at 32K).
    sinks: int = 0
    window: int = 0

    def bands(self, side: str, layer: int) -> list:
        """Layer `layer`'s bands per KV head (kvfold_runtime.bands.Band), side "k" or "v"."""
        return [bands_from_bits(h, self.scale) for h in (self.k_bits if side == "k" else self.v_bits)[layer]]

    def ranks(self) -> RankPlan:
        """The dims each head keeps at all (its bases are truncated to these)."""
        count = [[sum(b > 0 for b in head) for head in layer] for layer in self.k_bits]
        count_v = [[sum(b > 0 for b in head) for head in layer] for layer in self.v_bits]
        return RankPlan(d_k=count, d_v=count_v, head_dim=self.head_dim)

    def key(self) -> tuple:
        """Equal keys, equal caches (the search scores each once)."""
        return tuple(tuple(tuple(map(tuple, layer)) for layer in side) for side in (self.k_bits, self.v_bits))

    def config_block(self) -> ConfigBlock:
        """The kvfold block of config.json this plan's cache is (ranks, bits, scales, window)."""
        ranks = self.ranks()
        return ConfigBlock(ranks.d_k, ranks.d_v, False, *self.kept_bits(), self.scale, sinks=self.sinks,
                           window=self.window)

    def bytes_per_token(self, context: int | None = None) -> float:
        """Cached bytes per token, every layer's keys and values: codes and scales (the runtime's row layout), and
        for a windowed plan its whole rows at 2 bytes a number over `context` tokens [WINDOW_CONTEXT]."""
        return self.config_block().bytes_per_token(context=context or WINDOW_CONTEXT)  # read by a windowed plan only

    @property
    def compression(self) -> float:
        """p = 1 − cached bytes / the same cache in float16 (2 bytes per number): what a user compares with
        fp16, fp8 (p = 0.5) or int4."""
        return 1.0 - self.bytes_per_token() / fp16_bytes_per_token(self.head_dim, sum(map(len, self.k_bits)))

    def kept_bits(self) -> tuple[list, list]:
        """Per layer, head and kept dim (zeros dropped): the manifest's and config.json's k_bits / v_bits."""
        def kept(side):
            return [[[b for b in head if b] for head in layer] for layer in side]

        return kept(self.k_bits), kept(self.v_bits)

    def mean_bits(self) -> float:
        """Bits per stored number, averaged over every dim of K and V (dropped dims count 0); scales excluded."""
        every = [b for side in (self.k_bits, self.v_bits) for layer in side for head in layer for b in head]
        return sum(every) / len(every)
