"""Calibration speed and memory: each token count runs in a fresh process, so its peak RSS is its own.

Peak memory should not grow with the token count (Grams are O(d²) per head); the JSON shows it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvfold import api
from kvfold.errors import KVFoldError

__all__ = ["bench_calibrate", "one_point"]


def one_point(model: str, tokens: int, source: str, seq_len: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = api.calibrate(model, Path(tmp) / "calib", source=source, tokens=tokens, seq_len=seq_len,
                               batch=batch)
    return {
        "tokens": result.header.tokens,
        "model_load_s": round(result.seconds_load, 2),
        "collect_s": round(result.seconds_collect, 2),
        "tokens_per_s": round(result.header.tokens / result.seconds_collect, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def bench_calibrate(model: str, tokens: list[int], source: str, seq_len: int, batch: int) -> dict:
    for flag, values in (("--tokens", tokens), ("--seq-len", [seq_len]), ("--batch", [batch])):
        if min(values) < 1:
            raise KVFoldError(f"{flag} must be at least 1, got {min(values)}")
    if source not in ("random", "text"):
        raise KVFoldError(f"--source must be one of random, text, got '{source}'")
    api.prepare(model)  # bad models fail here; the embedded default's cache is built outside the timed runs
    points = []
    for n in tokens:
        cmd = [sys.executable, "-m", "kvfold_bench", "calibrate-point", model, "--tokens", str(n),
               "--source", source, "--seq-len", str(seq_len), "--batch", str(batch)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise KVFoldError(f"calibration of {n} tokens failed: {last[0].removeprefix('error: ')}")
        point = json.loads(done.stdout.strip().splitlines()[-1])
        point["wall_s"] = round(time.perf_counter() - t0, 2)  # whole command: start-up, load, collect, write
        points.append(point)
    return {
        "benchmark": "calibrate", "model": model, "source": source, "seq_len": seq_len, "batch": batch,
        "threads": _threads(), "points": points,
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()
