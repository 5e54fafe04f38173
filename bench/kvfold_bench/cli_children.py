"""The hidden `kvfold-bench` commands the benches start in child processes (one engine or measurement per
process): serve-point, serve-paired, memory-point, calibrate-point. Registered on kvfold_bench.cli's app."""

from __future__ import annotations

import json
from pathlib import Path

from kvfold.console import user_errors
from kvfold.io import atomic_write_text
from kvfold_bench.cli import app


@app.command("serve-point", hidden=True)
def serve_point(model: str, tokenizer_dir: str, out: Path, kv_cache_bytes: int = 1 << 29, kv_cache_dtype: str = "auto",
                requests: int = 64, prompt_tokens: int = 512, new_tokens: int = 512, long_prompt_tokens: int = 4096,
                long_new_tokens: int = 128, workload: str = "all", dtype: str = "float32", eager: bool = False,
                reference: Path | None = None, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                timing_only: bool = False) -> None:
    from kvfold_bench.serve_point import Workload, one_engine

    with user_errors():
        shape = Workload(requests, prompt_tokens, new_tokens, long_prompt_tokens, long_new_tokens, workload)
        probe = None if reference is None else json.loads(reference.read_text())
        result = one_engine(model, tokenizer_dir, kv_cache_bytes, kv_cache_dtype, shape, dtype, eager, probe,
                            tensor_parallel, pipeline_parallel, timing_only)
    atomic_write_text(out, json.dumps(result))


@app.command("serve-paired", hidden=True)
def serve_paired(spec: Path, out: Path) -> None:
    from kvfold_bench.serve_paired import paired_decode

    with user_errors():
        result = paired_decode(**json.loads(spec.read_text()))
    atomic_write_text(out, json.dumps(result))


@app.command("memory-point", hidden=True)
def memory_point(model: str, context: int = 4096, new_tokens: int = 32, batch: int = 1,
                 exported: bool = False) -> None:
    from kvfold_bench.memory import one_run

    with user_errors():
        result = one_run(model, exported, context, new_tokens, batch)
    print(json.dumps(result))


@app.command("calibrate-point", hidden=True)
def calibrate_point(model: str, tokens: int = 16384, source: str = "random", seq_len: int = 512,
                    batch: int = 8) -> None:
    from kvfold_bench.calibrate import one_point

    with user_errors():
        result = one_point(model, tokens, source, seq_len, batch)
    print(json.dumps(result))
