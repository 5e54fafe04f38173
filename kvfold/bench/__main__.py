"""python -m kvfold.bench calibrate [--model smollm2] [--tokens 4096 --tokens 16384]"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvfold.bench.calibrate import bench_calibrate, one_point

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)


@app.command()
def calibrate(
    model: Annotated[str, typer.Option(help="Model folder or alias.")] = "smollm2",
    tokens: Annotated[list[int] | None, typer.Option(help="Token counts, one fresh process each.")] = None,
    source: Annotated[str, typer.Option(help="random or text.")] = "random",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 512,
    batch: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
) -> None:
    """Time calibration and measure its peak memory; print JSON."""
    print(json.dumps(bench_calibrate(model, tokens or [4096, 16384], source, seq_len, batch), indent=2))


@app.command("calibrate-point", hidden=True)
def calibrate_point(model: str, tokens: int = 16384, source: str = "random", seq_len: int = 512,
                    batch: int = 8) -> None:
    print(json.dumps(one_point(model, tokens, source, seq_len, batch)))


if __name__ == "__main__":
    app()
