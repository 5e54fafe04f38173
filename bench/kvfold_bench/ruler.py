"""RULER through lm-eval (issue 51, item 3): an export and its original judged by a harness nobody here wrote, on
RULER's synthetic long-context tasks, served as a user serves them.

Both models are started at once, each as `vllm serve MODEL` starts it (vLLM's OpenAI server, the server's default
dtype unless --dtype names one; the export through kvfold-runtime's plugin) with a context of the longest length,
and lm-eval 0.4's `local-completions` model sends each in turn every task's prompts (greedy, RULER's own generation
lengths). Only the tasks whose haystacks need no download run offline: niah_single_1 (noise haystack),
niah_multikey_2/3 (haystacks of keys), ruler_vt, ruler_cwe, ruler_fwe; the essay-haystack ones load a Hub dataset. A
task's samples are RULER's own (lm-eval generates 500 per length from the model's tokenizer; the first `samples` are
scored).

On a CPU a request takes seconds to minutes, so a run is resumable at two levels: a re-run with the same JSON skips
every (model, task, length) it already holds at that many samples (the JSON is written after each, atomically), and
within one, lm-eval's own request cache (its `use_cache`, one SQLite file per model's files and served dtype under
$KVFOLD_CACHE/ruler) answers the requests a stopped run already sent, so it resumes at the next one.

Each cell keeps its per-sample scores, so the two models compare sample by sample (`export_higher`,
`original_higher`: at 50 samples one sample is 2 points) and the paired difference's standard error
(`difference_se_points`); a JSON written without them gets them from the request cache on its next run.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.embedded import cache_root
from kvfold_bench.openai_server import SERVER_DEFAULT, serve_all
from kvfold_bench.outputs import write_outputs

__all__ = ["OFFLINE_TASKS", "ruler"]

OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


def ruler(export: Path, original: Path, tasks: list[str], lengths: list[int], samples: int,
          json_path: Path | None, kv_cache_mib: int = 1024, dtype: str | None = None,
          only: str | None = None) -> dict:
    """Per model (original, export), task and length: RULER's score (the share of expected strings found, lm-eval's
    own metric) over the first `samples` samples, both served in vLLM's `dtype` (None: the server's default);
    `only` ("original" or "export"): that model alone (the original's screen of which tasks count)."""
    unknown = [t for t in tasks if t not in OFFLINE_TASKS]
    if unknown:
        raise KVFoldError(f"--task {', '.join(unknown)}: choose from the RULER tasks that run offline: "
                          f"{', '.join(OFFLINE_TASKS)}")
    report = _resumed(json_path, export, original, samples, dtype or SERVER_DEFAULT)
    models = {name: path for name, path in (("original", original), ("export", export)) if only in (None, name)}
    if json_path is not None:  # a JSON held: its missing per-sample scores filled, its rows this version's
        filled, points = _backfill(report, models, dtype), report["points"]
        report["points"] = _points(report["scores"])
        if filled or report["points"] != points:
            write_outputs(report, json_path, None, None)
    todo = {name: [(t, n) for t in tasks for n in lengths if str(n) not in report["scores"].get(name, {}).get(t, {})]
            for name in models}
    serving = {name: path for name, path in models.items() if todo[name]}
    if not serving:
        return report
    with serve_all(serving, dtype=dtype, max_model_len=max(lengths), kv_cache_bytes=kv_cache_mib << 20) as bases:
        for name, base in bases.items():
            cache = _request_cache(models[name], dtype) if json_path is not None else None
            for task, n in todo[name]:
                t0 = time.perf_counter()
                score, each = _evaluate(base, models[name], task, n, samples, cache)
                cell = {"score": score, "samples": samples, "seconds": round(time.perf_counter() - t0, 1),
                        "per_sample": each}
                report["scores"].setdefault(name, {}).setdefault(task, {})[str(n)] = cell
                report["points"] = _points(report["scores"])
                if json_path is not None:
                    write_outputs(report, json_path, None, None)
    return report


def _request_cache(model: Path, dtype: str | None) -> str:
    """lm-eval's use_cache prefix for `model` served in `dtype`: keyed by its files' names, sizes and times, so an
    export written again at the same path starts a new cache."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(model).iterdir() if f.is_file())
    key = hashlib.sha256(json.dumps([str(Path(model).resolve()), dtype, files]).encode()).hexdigest()[:24]
    folder = cache_root() / "ruler"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / key)


def _backfill(report: dict, models: dict, dtype: str | None) -> bool:
    """Each held cell's per-sample scores where it has none (a JSON written before they were kept), read from
    lm-eval's request cache with no server (a cell whose answers are not all cached keeps none). True if any."""
    filled = False
    for name, path in models.items():
        for task, by_length in report["scores"].get(name, {}).items():
            for n, cell in by_length.items():
                if "per_sample" in cell:
                    continue
                try:  # nothing listens at port 9: a request missing from the cache fails at once
                    score, each = _evaluate("http://127.0.0.1:9", path, task, int(n), cell["samples"],
                                            _request_cache(path, dtype))
                except Exception:  # lm-eval's own errors for a request it could not send
                    continue
                if score == cell["score"]:
                    cell["per_sample"], filled = each, True
    return filled


def _evaluate(base: str, model: Path, task: str, length: int, samples: int,
              cache: str | None = None) -> tuple[float, list[float]]:
    """lm-eval's score of one task at one length through the server at `base`, its answers cached at `cache`, and
    each sample's score (by lm-eval's document order)."""
    import lm_eval
    import lm_eval.tasks

    args = {"base_url": f"{base}/v1/completions", "model": str(model), "tokenizer": str(model),
            "tokenizer_backend": "huggingface", "tokenized_requests": False, "max_length": length,
            "num_concurrent": 1, "max_retries": 1, "timeout": 3600}
    metadata = {"max_seq_lengths": [length], "tokenizer": str(model)}
    # lm-eval's default TaskManager parses all of its ~14,000 task YAML files (25 s a call on a 2-core CPU): index
    # RULER's folder only, with the metadata simple_evaluate would give it (the model's arguments and ours)
    ruler_dir = Path(lm_eval.tasks.__file__).parent / "ruler"
    manager = lm_eval.tasks.TaskManager(include_path=str(ruler_dir), include_defaults=False, metadata=args | metadata) \
        if ruler_dir.is_dir() else None
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task], limit=samples,
                                  metadata=metadata, task_manager=manager, log_samples=True, bootstrap_iters=0,
                                  use_cache=cache)
    value = out["results"][task].get(f"{length},none")
    if not isinstance(value, (int, float)):
        raise KVFoldError(f"lm-eval gave no {length}-token score for {task}: {out['results'][task]}")
    each = [round(float(s[str(length)]), 4) for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]
    return round(float(value), 4), each


def _points(scores: dict) -> list[dict]:
    """Per task and length both models hold: their scores and the export's difference in points (×100)."""
    rows = []
    for task, by_length in scores.get("original", {}).items():
        for n, cell in by_length.items():
            other = scores.get("export", {}).get(task, {}).get(n)
            if other is not None:
                row = {"task": task, "length": int(n), "original": cell["score"], "export": other["score"],
                       "export_minus_original_points": round(100 * (other["score"] - cell["score"]), 2)}
                a, b = cell.get("per_sample"), other.get("per_sample")
                if a and b and len(a) == len(b):  # paired: the samples one model scored higher on than the other
                    row["export_higher"] = sum(y > x for x, y in zip(a, b, strict=True))
                    row["original_higher"] = sum(x > y for x, y in zip(a, b, strict=True))
                    if len(a) > 1:
                        row["difference_se_points"] = round(100 * _paired_se(a, b), 2)
                rows.append(row)
    return rows


def _paired_se(a: list[float], b: list[float]) -> float:
    """The standard error of mean(b) − mean(a) over paired samples: the spread of the per-sample differences over
    √n. The two models answer the same prompts, so this is far narrower than the two scores' own errors combined."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    return statistics.stdev(d) / math.sqrt(len(d))


def _resumed(json_path: Path | None, export: Path, original: Path, samples: int, dtype: str) -> dict:
    """The JSON to extend (the same export, original, sample count and dtype), or a new one."""
    fresh = {"benchmark": "ruler", "harness": "lm-eval local-completions through vllm.entrypoints.openai.api_server",
             "dtype": dtype, "export": str(export), "original": str(original), "samples": samples, "scores": {},
             "points": []}
    if json_path is None or not json_path.is_file():
        return fresh
    old = json.loads(json_path.read_text())
    if (old.get("benchmark"), old.get("export"), old.get("original"), old.get("samples"),
            old.get("dtype", SERVER_DEFAULT)) != ("ruler", str(export), str(original), samples, dtype):
        raise KVFoldError(f"{json_path} holds another run (export, original, --samples or --dtype differ): give "
                          "another --json to start one")
    return old
