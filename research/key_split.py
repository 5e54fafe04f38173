"""The K/V split once keys may take 2 bits (issue 51): kvfold-bits-k2 with θ_v/θ_k at export's V_SCALE times 1/4,
1/2, 2 and 4 (`kvfold-bits-k2-v0.25` … `-v4`), beside export's own, on the frontier at long context. Export's
V_SCALE was measured with keys held at 4 bits or more (plan/formats/bits.py); this says whether it still holds.

`kvfold-bench frontier ARGV` with the variants registered, e.g.

    .venv/bin/python -m research.key_split --model smollm2 --context 4096 --score-from 1024 \\
        --eval-text wiki:eval+pysrc:eval --eval-tokens 16384 --method kvfold-bits-k2:s16w64@2.625 \\
        --method kvfold-bits-k2-v0.25:s16w64@2.625 --method kvfold-bits-k2-v4:s16w64@2.625 --json OUT.json
"""

from __future__ import annotations

import dataclasses

from kvfold_bench.frontier.methods import METHODS, register
from research.frontier_limit import frontier

__all__ = ["FACTORS", "main", "register_variants"]

FACTORS = (0.25, 0.5, 2.0, 4.0)


def register_variants() -> None:
    """kvfold-bits-k2-vF for each F in FACTORS: θ_v/θ_k = F·V_SCALE (never in the bench's default set)."""
    base = METHODS["kvfold-bits-k2"]
    for f in FACTORS:
        register(dataclasses.replace(base, name=f"{base.name}-v{f:g}", label=f"{base.label}, θ_v/θ_k × {f:g}",
                                     v_scale=base.v_scale * f))


def main(argv: list[str] | None = None) -> None:
    """`kvfold-bench frontier ARGV` with the variants registered."""
    register_variants()
    frontier(argv, "python -m research.key_split")


if __name__ == "__main__":
    main()
