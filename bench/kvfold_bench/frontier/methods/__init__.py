"""The methods on the frontier, registered by name. Adding one = a file (or a variant line) + a line here
+ a row in tests/bench/test_frontier_methods.py (test_frontier_long.py for long-context ones). Code outside the
bench adds its own with `register` (e.g. research/frontier_limit.py's references): run only when named."""

from __future__ import annotations

import dataclasses
import re

from kvfold.errors import KVFoldError

from .base import Candidate, Method
from .bits import KVFoldBits
from .fp8 import Fp8
from .gain import KVFoldGain
from .int2 import KVFoldInt2
from .kvfold import KVFold
from .oscar import Oscar
from .palu import Palu
from .quant import IntPerToken, Kivi
from .recent import Recent
from .think import ThinK
from .turboquant import TurboQuant
from .uniform import Uniform
from .vllm_kv import VllmPerTokenHead

__all__ = ["DEFAULT", "METHODS", "PEERS", "Candidate", "Method", "get_methods", "register"]

# Grids: where each method's curve crosses 0.99 on SmolLM2 (GQA and MHA), plus a point or two past it.
_ALL: list[Method] = [
    KVFold(),
    # kvfold's ablations: each changes one choice of the default
    KVFold(name="kvfold-shared-r", label="kvfold, one r for K and V (eq6)", allocation="eq6",
           grid=(0.01, 0.015, 0.02, 0.03)),
    KVFold(name="kvfold-split-r", label="kvfold, r_v = r_k/4 (eq6)", allocation="eq6", v_scale=0.25,
           grid=(0.01, 0.02, 0.03, 0.04)),
    KVFold(name="kvfold-random", label="kvfold, random-token calibration", calib="random",
           grid=(0.001, 0.0025, 0.005, 0.01)),
    KVFold(name="kvfold-zdc", label="kvfold, ZDC pruning + K-means calibration", calib="zdc",
           grid=(0.001, 0.0025, 0.005, 0.01)),
    # the papers' method as published (ZACK/FDC): common [Q;K] / [V;W_O] rotations from random tokens,
    # one removal rate for every head
    KVFold(name="zack", label="ZACK/FDC (papers)", factors="zack", calib="random", allocation="eq6",
           grid=(0.005, 0.01, 0.015, 0.02, 0.03)),
    Uniform(),
    Palu(),
    ThinK(),
    Fp8(),
    KVFold(name="kvfold+fp8", label="kvfold + fp8", fp8=True, grid=(0.0025, 0.005, 0.0075, 0.01, 0.015)),
    # the transform-coded cache (issue 13) and the quantized caches a user would pick instead of it
    KVFoldBits(),
    KVFoldBits(name="kvfold-bits-heads", label="kvfold-bits, per-head θ from rounding costs", allocation="sensitivity"),
    KVFoldBits(name="kvfold-bits-unaligned", label="kvfold-bits, bands anywhere (--band-align 1)", align=1),
    KVFoldBits(name="kvfold-bits-k2", label="kvfold-bits, keys down to 2 bits", key_min=2),
    KVFoldBits(name="kvfold-bits-k3", label="kvfold-bits, keys down to 3 bits", key_min=3),
    KVFoldBits(name="kvfold-bits-keys4", label="kvfold-bits, θ_v/θ_k 4× export's (more bytes on keys)",
               v_scale=4 * KVFoldBits.v_scale),
    KVFoldBits(name="kvfold-bits-values4", label="kvfold-bits, θ_v/θ_k ¼ of export's (more bytes on values)",
               v_scale=KVFoldBits.v_scale / 4),
    IntPerToken(8),
    IntPerToken(4),
    Kivi(4),
    Kivi(2),
    # vLLM 0.32's own compressed caches (--kv-cache-dtype), stored bit for bit as vLLM stores them (issue 25)
    VllmPerTokenHead("int8_per_token_head"),
    VllmPerTokenHead("fp8_per_token_head"),
    VllmPerTokenHead("int4_per_token_head"),
    TurboQuant("turboquant_k8v4"),
    TurboQuant("turboquant_4bit_nc"),
    TurboQuant("turboquant_k3v4_nc"),
    TurboQuant("turboquant_3bit_nc"),
    # the newest 2-bit caches (issue 51): OSCAR as its authors publish it, its sink and recent tokens whole
    Oscar(),
    Oscar(name="oscar-shifted", label="OSCAR, keys less their calibration mean (kvfold's key shift)", shift=True),
    KVFoldInt2(),  # OSCAR's quantizer and whole tokens in kvfold's bases (a diagnostic: which part makes OSCAR cheap)
    KVFoldInt2(name="kvfold-int2-orth", label="kvfold-int2, key basis made orthonormal", orthonormal=True),
    # kvfold's plans with one scale a row instead of one a band (a diagnostic: where kvfold-bits' low-bit cliff is from)
    KVFoldGain(),
    KVFoldGain(name="kvfold-gain-k2", label="kvfold-gain, keys down to 2 bits", key_min=2),
    KVFoldGain(name="kvfold-gain-static", label="kvfold-gain without the gain (steps from calibration only)",
               gain=False),
]
METHODS: dict[str, Method] = {m.name: m for m in _ALL}
DEFAULT = tuple(METHODS)  # fixed here: methods registered later run only when named
# On further models (the MHA variant: GQA vs MHA) kvfold against each peer, without the ablations.
PEERS = ("kvfold", "zack", "uniform", "palu", "think", "fp8", "kvfold+fp8", "kvfold-bits", "int8", "int4", "kivi4",
         "kivi2", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "turboquant_k8v4",
         "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "oscar")


ALIASES = {"fdc": "zack"}  # the papers' method goes by either paper's name


def register(method: Method) -> None:
    """Add `method` to METHODS under its name, never to DEFAULT or PEERS: it runs when named (`--method NAME`).
    Registering the same method again does nothing; another method under a taken name is an error."""
    if METHODS.get(method.name, method) != method:
        raise ValueError(f"a frontier method named {method.name!r} is already registered")
    METHODS[method.name] = method


_RECENT = re.compile(r"^(.+):s(\d+)w(\d+)$")


def get_methods(names: list[str]) -> list[Method]:
    """The methods by name. A method with a knob grid takes its sweep narrowed after an @: `kvfold-bits@4.5,4.25`
    sweeps those knob values only (the same method, fewer points: a focused comparison). `NAME:sSwW` is NAME with
    its first S and each query's last W tokens kept whole (methods/recent.py): `kvfold-bits:s64w256@3,2.5`."""
    recent = {}
    for i, n in enumerate(names):
        base, at, grid = n.partition("@")
        if m := _RECENT.match(base):
            names = [*names[:i], m.group(1) + at + grid, *names[i + 1:]]
            recent[i] = (int(m.group(2)), int(m.group(3)))
    parsed = [(ALIASES.get(base, base), at + grid) for base, at, grid in (n.partition("@") for n in names)]
    unknown = [n for n, _ in parsed if n not in METHODS]
    if unknown:
        raise KVFoldError(f"unknown method {', '.join(unknown)}; choose from: {', '.join(METHODS)} (fdc = zack)")
    out = []
    for name, grid in parsed:
        method = METHODS[name]
        if grid:  # "@…"
            try:
                values = tuple(float(v) for v in grid[1:].split(","))
            except ValueError:
                values = ()
            if not hasattr(method, "grid") or not values:
                raise KVFoldError(f"--method {name}{grid}: only a method with a knob grid takes @v1,v2,… (numbers), "
                                  f"e.g. kvfold-bits@4.5,4.25")
            method = dataclasses.replace(method, grid=values)
        out.append(method)
    for i, (sinks, window) in recent.items():
        out[i] = Recent(out[i], sinks, window)
    return out
