"""The frontier with two references that are not caches (issue 25, item 4): kvfold-bits' plans and bytes with an
ideal coder's error instead of the band codes' (research/ideal.py) — kvfold-bits-limit at the rate-distortion
limit, kvfold-bits-limit+2dB a coder 2 dB above it: how far a better coder of the same plans could go.

`kvfold-bench frontier` with these two registered in its method registry (kvfold_bench.frontier.methods.register);
every argument is the bench's. What produced docs/frontier-limit.json and .png:

    .venv/bin/python -m research.frontier_limit --model smollm2 --method kvfold-bits --method kvfold-bits-limit \\
        --method kvfold-bits-limit+2dB --method int4_per_token_head \\
        --json docs/frontier-limit.json --png docs/frontier-limit.png
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvfold_bench.frontier.methods import register
from kvfold_bench.frontier.methods.bits import KVFoldBits
from research.ideal import ideal

__all__ = ["REFERENCES", "IdealCoderBits", "frontier", "main", "register_references"]


@dataclass(frozen=True)
class IdealCoderBits(KVFoldBits):
    """kvfold-bits' plans and bytes (scales counted), each band of each token row through the ideal coder
    `gap_db` above the limit."""

    gap_db: float = 0.0

    def coder(self) -> Callable[[list], Callable]:
        seeds = itertools.count()  # each layer side its own noise, the same draws on every run
        return lambda bands: ideal(bands, self.gap_db, next(seeds))


REFERENCES = (
    IdealCoderBits(name="kvfold-bits-limit", label="kvfold-bits plans, ideal coder (rate-distortion limit)"),
    IdealCoderBits(name="kvfold-bits-limit+2dB", label="kvfold-bits plans, a coder 2 dB above the limit",
                   gap_db=2.0),
)


def register_references() -> None:
    """Make the references nameable in `--method` (never in the bench's default set)."""
    for method in REFERENCES:
        register(method)


def frontier(argv: list[str] | None, prog_name: str) -> None:
    """`kvfold-bench frontier ARGV` (sys.argv's when None), for a research module that registered its methods first."""
    import typer

    from kvfold_bench import cli

    cli.log_to_stderr()
    command = typer.main.get_command(cli.app).commands["frontier"]
    command.main(sys.argv[1:] if argv is None else argv, prog_name=prog_name)


def main(argv: list[str] | None = None) -> None:
    """`kvfold-bench frontier ARGV` with the references registered."""
    register_references()
    frontier(argv, "python -m research.frontier_limit")


if __name__ == "__main__":
    main()
