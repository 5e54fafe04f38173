"""Bits per rotated dim (transform coding): the bit-band cache format's allocation (issue 13).

In kvfold's bases the dims of a KV head are decorrelated and ordered by importance λ_j — for keys
λ_j = σ_j², σ the whitened Q/K spectrum (E[(qA)_j²] = E[(kB)_j²] = σ_j, so an error e in k'_j costs
σ_j·E[e²] in the scores and dropping it costs σ_j²); for values λ_j = E[(v A_v)_j²], the values' own mean
square along each axis (`LayerBasis.v_energy`): attention averages a stored value's error with weights that do
not depend on the axis, and the axes are orthonormal, so an error costs the same on every axis and only its size
— set by the value's own spread — differs. (Priced by the attention *output*'s spectrum², as the rank format
orders its dims, values got too few bits: averaging shrinks every axis but the mean's, so the output spectrum
is steeper than the values'. Measured on SmolLM2, 2026-11-25, 4,096 tokens of wiki:eval+pydoc:eval, 0.2775 of
fp16's bytes, no layer multipliers: mean KL 0.0264 → 0.0205.) The value axes are therefore re-ordered by λ for
the bits format (`bits_basis`). Storing dim j at b bits costs about λ_j·2^(−2b) (uniform quantization of
a variance-λ number), dropping it λ_j. Reverse water-filling minimises Σ cost for a bit budget; over a
discrete set of widths, for a multiplier θ, each head's widths minimise

    Σ_j λ̂_j · 2^(−2b_j) + θ · b_j   +   θ · 8 · (bands of 2..8 bits)

with λ̂ the head's λ normalised to sum 1, so one θ means the same relative distortion in every head (as
one removal rate r does for ranks), and the last term charges each band its per-token scale (one byte,
kvfold_runtime.bands "log8"; without this term SmolLM2 at 4 bits per number spent 0.089 of the fp16 bytes
on float16 scales, with it 0.032). Widths never increase along the dims (λ descending), so equal widths
form contiguous bands (kvfold_runtime.bands); a dynamic programme over (dim, width) finds the exact
minimum. With the bands aligned (BitRule.align, formats/bits.ALIGN = 16 by default) the widths are constant on
each chunk of `align` dims and the same programme runs over chunks: the exact minimum among aligned widths. Larger
θ, fewer bits. Per-layer sensitivity multipliers (--allocation sensitivity) scale θ exactly as they scale r
(plan/sensitivity.py). Measured on the bits format they cost accuracy — they were measured by removing dims, not
rounding them (SmolLM2, as above: KL 0.0388 with them and 0.0264 without when values were
priced by the output spectrum; 0.0375 and 0.0222 with today's pricing at V_SCALE 16) — and export's default
allocation (eq6) has none. The accuracy search then runs over θ. Last, the dims inside each quantized band are
mixed by an orthogonal DCT folded into the weights (`bit_factors`), so one absmax scale fits them better.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

import torch

from kvfold.errors import KVFoldError
from kvfold.factors import LayerBasis, LayerFactors
from kvfold.plan.bit_plan import KEY_MIN_BITS, SCALE, WINDOW_CONTEXT, BitPlan, BitRule  # the plan (re-exported)
from kvfold.plan.formats.bits import ALIGN, V_SCALE  # the bands' alignment and θ_v / θ_k by default (said there)
from kvfold.plan.ranks import factors_for
from kvfold_runtime import BAND_SCALES

__all__ = ["ALIGN", "KEY_MIN_BITS", "SCALE", "V_SCALE", "WINDOW_CONTEXT", "BitPlan", "BitRule", "band_mixer",
           "bit_factors", "bits_basis", "check_align", "dim_bits", "modelled_distortion", "plan_bits",
           "theta_for_mean_bits"]


def check_align(head_dim: int, align: int) -> None:
    """KVFoldError, with the fix, unless `head_dim` splits into whole chunks of `align` dims."""
    if align < 1 or head_dim % align:
        raise KVFoldError(f"head_dim {head_dim} is not a multiple of the bits format's band alignment {align}: "
                          f"export with --band-align 1 (bands anywhere) or a divisor of {head_dim}")


def dim_bits(spectrum: torch.Tensor, theta: float, widths: tuple[int, ...], scale_bits: int = 8,
             align: int = 1) -> list[int]:
    """One head's widths from its spectrum (descending σ): the non-increasing sequence b_0 ≥ b_1 ≥ … that
    minimises Σ_j (λ̂_j·2^(−2b_j) + θ·b_j) + θ·scale_bits·(bands below 16 bits) — the water-filling above,
    charged for each band's per-token scale. Dynamic programming over (dim, width): a band opens where the
    width steps down. With `align` > 1, the same over chunks of `align` dims [a·c, a·c + a), one width each (a
    chunk's cost is its dims' summed: Σλ̂·2^(−2b) + θ·a·b), so every band starts and ends on a multiple of `align`;
    the spectrum's length must be one of those (check_align)."""
    check_align(len(spectrum), align)
    lam = spectrum.double() ** 2
    total = float(lam.sum())
    if total == 0.0:
        return [0] * len(spectrum)
    ws = sorted(widths, reverse=True)
    opening = [theta * scale_bits if 0 < w < 16 else 0.0 for w in ws]
    # cost[w]: the best cost of chunks 0..c with chunk c at width ws[w]; came[c][w]: chunk c−1's width index
    cost, came = None, []
    for x in (lam / total).view(-1, align).sum(-1).tolist():  # each chunk's λ̂ (align 1: each dim's, as it was)
        own = [x * 2.0 ** (-2 * w) + theta * w * align for w in ws]
        if cost is None:
            cost = [own[i] + opening[i] for i in range(len(ws))]
            came.append([i for i in range(len(ws))])
            continue
        new, back, best, best_i = [], [], math.inf, -1
        for i in range(len(ws)):  # ws descending: the best of the wider widths so far, opening a band at i
            stay = cost[i]
            if best + opening[i] < stay:
                new.append(own[i] + best + opening[i])
                back.append(best_i)
            else:
                new.append(own[i] + stay)
                back.append(i)
            if cost[i] < best:
                best, best_i = cost[i], i
        cost = new
        came.append(back)
    i = min(range(len(ws)), key=lambda k: (cost[k], -ws[k]))
    out = []
    for back in reversed(came):
        out += [ws[i]] * align
        i = back[i]
    return out[::-1]


def modelled_distortion(spectrum: torch.Tensor, bits: list[int]) -> float:
    """The water-filling's own price of one head's widths (descending σ): Σ_j λ̂_j·2^(−2b_j), a dropped dim
    costing λ̂_j — the relative distortion one θ equalises across heads (plan/rounding.py measures what it
    costs the model)."""
    lam = spectrum.double() ** 2
    lam = lam / lam.sum().clamp_min(1e-300)
    return float(sum(x * (2.0 ** (-2 * b) if b else 1.0) for x, b in zip(lam.tolist(), bits, strict=True)))


def bits_basis(basis: LayerBasis) -> LayerBasis:
    """The basis as the bits format orders and prices its value dims: A_v's columns sorted by the values' own
    mean square (v_energy), descending, and v_spectrum = its square root, so the water-filling's λ is what a
    value's rounding error costs (module docstring). Without a measured v_energy, the basis unchanged."""
    if basis.v_energy is None:
        return basis
    order = torch.argsort(basis.v_energy, dim=-1, descending=True, stable=True)  # [H_kv, d]
    v_a = torch.stack([basis.v_a[g][:, order[g]] for g in range(order.shape[0])])
    spectrum = basis.v_energy.gather(-1, order).sqrt().to(basis.v_spectrum.dtype)
    return replace(basis, v_a=v_a, v_spectrum=spectrum, v_energy=None)


# Keys are never dropped in the bits format, nor stored below 4 bits by default (KEY_MIN_BITS, BitRule.key_min). The
# water-filling prices key dim j at λ̂_j = σ_j² of its own head, and on Qwen2.5-Coder-1.5B that is far too cheap for
# the small dims of layers 0–1, whose attention is sharply peaked (layer 0's scores have rms ~2,700 at 1/√d), so a
# small relative error there moves the logits most. Measured 2026-11-26 (4,096 tokens, bfloat16, 16K-token
# calibration), the plan as priced vs the same plan with its key dims raised:
#   dropped keys → 2 bits (pysrc:dev, before the key shift): θ_v 1e-7: 0.514 → 0.516 of fp16's bytes, perplexity
#   ratio 1.0175 → 1.0078; θ_v 1e-5: 38.2 → 1.061; θ_v 1e-4: 3986 → 1.221.
#   2 → 4 bits (wiki:dev, with the key shift): θ_v 1e-7: 0.516 → 0.518, KL 0.0034 → 0.0013 (all of the 0.0034 was
#   layer 0's keys: quantizing them alone gives 0.0033, every other layer's 0.0007); θ_v 1e-6: 0.408 → 0.412, KL
#   0.0174 → 0.0017, perplexity ratio 1.018 → 1.002; θ_v 1e-4: 0.224 (3 bits) → 0.245, KL 0.046 → 0.019.
# On SmolLM2 (wiki:eval+pydoc:eval, float32) it costs little and helps at low budgets: θ_v 3e-5: 0.327 → 0.330 of
# fp16, KL 0.0062 → 0.0056; θ_v 1e-4: 0.270 → 0.283, KL 0.025 → 0.017 (perplexity ratio 1.027 → 1.011). Values may
# still drop dims and take 2 bits (their λ is their own energy, priced right). At long context with whole sink and
# recent tokens the floor is what starves values below 3.5 bits a number; `--key-bits 2` lifts it (plan/formats/bits.py
# has what that gains and what it cost the pass keys).

def _key_widths(widths: tuple[int, ...], key_min: int = KEY_MIN_BITS) -> tuple[int, ...]:
    return tuple(w for w in widths if w >= key_min) or (max(widths),)


def plan_bits(bases: list[LayerBasis], rule: BitRule) -> BitPlan:
    k_bits, v_bits, scale_bits = [], [], 8 * BAND_SCALES[rule.scale]
    key_widths = _key_widths(rule.widths, rule.key_min)
    for i, b in enumerate(map(bits_basis, bases)):
        tk, tv = rule.head_thetas(i, len(b.qk_spectrum))
        k_bits.append([dim_bits(s, t, key_widths, scale_bits, rule.align)
                       for s, t in zip(b.qk_spectrum, tk, strict=True)])
        v_bits.append([dim_bits(s, t, rule.widths, scale_bits, rule.align)
                       for s, t in zip(b.v_spectrum, tv, strict=True)])
    return BitPlan(k_bits=k_bits, v_bits=v_bits, head_dim=bases[0].qk_spectrum.shape[-1], scale=rule.scale,
                   sinks=rule.sinks, window=rule.window)


def theta_for_mean_bits(bases: list[LayerBasis], bits: float, widths: tuple[int, ...], v_scale: float = 1.0,
                        head_k: tuple[tuple[float, ...], ...] = (), head_v: tuple[tuple[float, ...], ...] = (),
                        align: int = ALIGN, key_min: int = KEY_MIN_BITS) -> float:
    """The θ_k (θ_v = v_scale·θ_k, no per-layer multipliers; per-head ones if given) whose plan, with bands aligned
    to `align` dims, stores about `bits` per number: for sweeps by budget."""
    def rule(theta: float) -> BitRule:
        return BitRule(theta, v_scale * theta, widths, head_k=head_k, head_v=head_v, align=align, key_min=key_min)

    lo, hi = math.log(1e-9), math.log(1.0)
    for _ in range(40):
        mid = (lo + hi) / 2
        if plan_bits(bases, rule(math.exp(mid))).mean_bits() > bits:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


@cache
def band_mixer(n: int) -> torch.Tensor:
    """[n, n] orthonormal DCT-II, float64: a band's dims are rotated by it (columns of the basis times it)."""
    i = torch.arange(n, dtype=torch.float64)
    m = torch.cos(math.pi * (i[None, :] + 0.5) * i[:, None] / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m.T.contiguous()


def bit_factors(bases: list[LayerBasis], plan: BitPlan) -> list[LayerFactors]:
    """Every layer's factors for a bits plan: the bases in the bits format's order (bits_basis) truncated to the
    kept dims, then the dims of each band below 16 bits mixed by an orthonormal DCT (band_mixer).

    Why: a band's per-token scale is set by its largest value, and its dims are ordered by variance, so the
    first dims set one step for all the others (measured: the real distortion of SmolLM2's bands is 1.5× what
    per-dim scales would give). An orthogonal mix spreads every dim's energy over the band, so the absmax
    falls towards the band's RMS; every dim keeps the same step, so the error each adds is unchanged. It is
    folded into the weights like the rotation itself — q A R · (k B R)ᵀ = q A Bᵀ kᵀ and v A R (B R)ᵀ = v A Bᵀ —
    so the served model and its cache format do not change. Measured on SmolLM2 (2026-11-25, 6,132 wiki:eval
    tokens, the frontier's plans): mean KL 0.0224 → 0.0188 at 0.304 of fp16's bytes, 0.0331 → 0.0261 at 0.289,
    0.0428 → 0.0348 at 0.2775 (a seeded random rotation and, where sizes allow, Hadamard gave the same)."""
    def mixed(kv_side: list[torch.Tensor], q_side: list[torch.Tensor], bands: list, group: int) -> tuple[list, list]:
        """KV head g's matrix and its query heads' (keys: B_g and A_h; values: A_v and B_h), each band's
        columns times its mixer."""
        kv_side, q_side = [m.clone() for m in kv_side], [m.clone() for m in q_side]
        for g, head in enumerate(bands):
            for band in (b for b in head if b.scaled):
                at = slice(band.start, band.start + band.size)
                for m in (kv_side[g], *q_side[g * group : (g + 1) * group]):
                    m[:, at] = m[:, at] @ band_mixer(band.size).to(m)
        return kv_side, q_side

    out = []
    for i, f in enumerate(factors_for([bits_basis(b) for b in bases], plan.ranks())):
        qk_b, qk_a = mixed(f.qk_b, f.qk_a, plan.bands("k", i), f.group)
        v_a, o_b = mixed(f.v_a, f.o_b, plan.bands("v", i), f.group)
        out.append(replace(f, qk_a=qk_a, qk_b=qk_b, v_a=v_a, o_b=o_b))
    return out
