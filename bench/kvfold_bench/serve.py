"""Serving in vLLM with one KV memory budget: the original, kvfold exports (kvfold-runtime's plugin) and the
original under vLLM's own `kv_cache_dtype` values, side by side.

Every configuration runs in a process of its own (`serve-point`, bench/kvfold_bench/serve_point.py: one vLLM engine per
process, forked from kvfold's engine host, which imported vLLM once and ran nothing: none inherits another's
memory or compiled code) with the same `kv_cache_memory_bytes`.
Reported from vLLM's own accounting: the KV blocks it allocated in that budget (× block size = the token
capacity; budget ÷ capacity = bytes per token, at most one block's rounding above the page's share), the
peak number of requests it ran at once, and the tokens/s of a cache-limited workload and of batch-1
decode at a long context. A built-in dtype whose probe (serve_point.reads_back) shows its cache is not read
back as written, or whose engine fails, is reported with `"runs": false` and why, without throughput.
With `rounds` > 1 every configuration that runs is run again in fresh engines, round by round (tokens/s only),
and each speed's ratio to the original's is reported per round and as their median (`round_figures`).
With `paired_steps` > 0 (and the long-context workload), every configuration that runs then decodes batch 1 at the
long context in one process, the engines taking turns (bench/kvfold_bench/serve_paired.py): the decode ratio that the
drift between engines started one after another does not blur.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.sources.models import resolve_model
from kvfold_bench.engine_host import run_module
from kvfold_bench.engine_log import root_cause
from kvfold_bench.serve_paired import BLOCK, WARMUP
from kvfold_bench.serve_point import (
    PROBE_MAX_PPL,
    PROBE_MIN_TOP1,
    PROBE_PROMPT_TOKENS,
    PROBE_PROMPTS,
    PROBE_TOKENS,
    Workload,
    agreement,
    cpu_threads_bind,
)

__all__ = ["DEFAULT_KV_DTYPES", "KV_DTYPES", "SPEEDS", "bench_serve", "capacity_figures", "layout_capacities",
           "round_figures", "tensor_parallel_figures"]

log = logging.getLogger(__name__)

# vLLM 0.32's CacheDType less "auto" (the original's own run); tests check it against the installed vLLM
KV_DTYPES = ("float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
             "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
             "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
DEFAULT_KV_DTYPES = ("fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
                     "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# the speeds compared with the original's, once per round: (workload, its tokens/s)
SPEEDS = (("cache_limited", "generated_tokens_per_s"), ("long_context", "decode_tokens_per_s"))


def _run(model: str, tokenizer_dir: Path, args: dict, reference: list[list[int]] | None = None) -> dict:
    """One configuration in a process of its own; {"error": the root cause} when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        cmd = ["serve-point", model, str(tokenizer_dir), str(out)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in args.items() if not isinstance(v, bool)]
        cmd += [f"--{k.replace('_', '-')}" for k, v in args.items() if v is True]  # eager, timing_only
        if reference is not None:
            (Path(tmp) / "reference.json").write_text(json.dumps(reference))
            cmd += [f"--reference={Path(tmp) / 'reference.json'}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        workers = args["tensor_parallel"] * args["pipeline_parallel"]
        if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(workers)  # ignored by vLLM's GPU builds
        done = run_module("kvfold_bench", cmd, env=env)
        if done.returncode != 0 or not out.exists():
            return {"error": root_cause(done.stdout + done.stderr)}
        return json.loads(out.read_text())


def layout_capacities(manifest: Manifest, budget: int, block_size: int, dtype: str) -> dict:
    """KV tokens vLLM gives `budget` bytes under each way to declare a rank export's per-head widths, by
    vLLM's page formula (a page = block_size × Σ over a layer's declared KV heads of (head_size + head_size_v)
    × bytes; all layers share one block pool): the packed layout kvfold uses (one KV head of Σd_k / Σd_v per
    layer), padding every head of a layer to its widest, and one Attention per bucket of equal widths."""
    per_layer = {"packed": [], "pad_to_layer_max": [], "buckets": []}
    buckets = 0
    for d_k, d_v in zip(manifest.d_k, manifest.d_v, strict=True):
        pairs = list(zip(d_k, d_v, strict=True))
        per_layer["packed"].append(sum(d_k) + sum(d_v))
        per_layer["pad_to_layer_max"].append(len(pairs) * (max(d_k) + max(d_v)))
        per_layer["buckets"].append(sum(k + v for k, v in pairs))
        buckets += len(set(pairs))
    out = {}
    for name, numbers in per_layer.items():
        page = block_size * sum(numbers) * _BYTES[dtype]
        out[name] = {"kv_token_capacity": budget // page * block_size, "page_bytes": page}
    out["buckets"]["attention_calls_per_step"] = buckets
    out["packed"]["attention_calls_per_step"] = out["pad_to_layer_max"]["attention_calls_per_step"] = len(manifest.d_k)
    return out


def capacity_figures(run: dict, original: dict) -> dict:
    """From vLLM's block count and the budget: the token capacity, bytes per token (budget ÷ capacity) and
    the ratios against the original's run (capacity, peak running requests, tokens/s where both measured)."""
    capacity = run["kv_token_capacity"]  # blocks × block size; a windowed export's rings counted (serve_point)
    out = {"kv_token_capacity": capacity,
           "bytes_per_token": round(run["kv_cache_memory_bytes"] / capacity, 1) if capacity else None}
    ratios = {"kv_token_capacity": round(capacity / original["kv_token_capacity"], 4)}
    for workload, key in (("cache_limited", "peak_running_requests"), *SPEEDS):
        mine, theirs = run.get(workload, {}).get(key), original.get(workload, {}).get(key)
        if mine is not None and theirs:
            ratios[key] = round(mine / theirs, 4)
    return {**out, "vs_original": ratios}


def _original_bytes_per_token(path: Path, dtype: str) -> int:
    """The uncompressed cache: layers × 2 (K, V) × KV heads × head_dim × element bytes."""
    from transformers import AutoConfig

    from kvfold_runtime import head_dim

    c = AutoConfig.from_pretrained(path)
    return c.num_hidden_layers * 2 * (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) \
        * head_dim(c) * _BYTES[dtype]


def _names(exports: list[Path]) -> list[str]:
    names = []
    for e in exports:
        name = f"export:{e.name}"
        names.append(name if name not in names and name != "original" else f"{name}#{len(names) + 1}")
    return names


def tensor_parallel_figures(run: dict, manifest: Manifest, budget: int, dtype: str, size: int) -> dict:
    """Each tensor-parallel rank's KV capacity (vLLM's block count in the rank's `budget`) against the ideal split:
    every rank holding 1/size of the export's bytes per token. Below 1 by what padding uneven ranks costs
    (kvfold_runtime.sharding), and by a block's rounding."""
    nominal = manifest.config_block().bytes_per_token(_BYTES[dtype])
    ideal = budget * size // nominal
    capacity = run["kv_blocks"] * run["block_size"]
    return {"size": size, "balanced_for": manifest.tensor_parallel, "rank_budget_bytes": budget,
            "rank_ideal_bytes_per_token": round(nominal / size, 1), "rank_ideal_kv_token_capacity": ideal,
            "capacity_vs_ideal": round(capacity / ideal, 4), "within_3_percent": capacity >= 0.97 * ideal}


def _export_entry(run: dict, manifest: Manifest, original: dict, budget: int, dtype: str) -> dict:
    """An export's run with its format's own bytes per token and the capacity ratio those promise."""
    fmt = "rank" if manifest.k_bits is None else "bits"
    block = manifest.config_block()  # a windowed export's bytes at the served context (whole rows at the dtype)
    nominal = block.bytes_per_token(_BYTES[dtype], context=run["max_model_len"] if block.windowed else None)
    ideal = original["format_bytes_per_token"] / nominal
    entry = {"kind": "export", "format": fmt, "compression_p": round(manifest.chosen.compression, 4),
             "format_bytes_per_token": nominal, **run, "runs": True, "ideal_capacity_ratio": round(ideal, 4),
             "capacity_target_met": run["kv_token_capacity"] >= 0.97 * ideal * original["kv_token_capacity"]}
    if fmt == "rank":  # the lead the plugin follows, against the alternatives, by vLLM's page formula
        entry["layouts"] = layout_capacities(manifest, budget, run["block_size"], dtype)
    if run["tensor_parallel_size"] > 1 and run["pipeline_parallel_size"] == 1:
        entry["tensor_parallel"] = tensor_parallel_figures(run, manifest, budget, dtype, run["tensor_parallel_size"])
    return entry


def _dtype_entry(kv_dtype: str, run: dict) -> dict:
    """A built-in kv_cache_dtype's run; why it does not run, when it does not."""
    entry = {"kind": "kv_cache_dtype", **run}
    if "error" in run:
        return entry | {"kv_cache_dtype": kv_dtype, "runs": False, "reason": f"the engine failed: {run['error']}"}
    if not run["runs"]:
        p = run["probe"]
        entry["reason"] = (f"the cache is not read back as written: reading the probe's prompts, its next-token top-1 "
                           f"agrees with kv_cache_dtype=auto's on {p['top1_agreement']:.3f} of positions (runs needs "
                           f"≥ {PROBE_MIN_TOP1}), its perplexity is {p['ppl_ratio']:.4g}× auto's (≤ {PROBE_MAX_PPL}); "
                           f"greedy tokens {p['greedy_tokens_equal']} of {p['greedy_tokens']} equal")
        known = run.get("cpu_attention_cache_dtypes")
        if known is not None and kv_dtype not in known:
            entry["reason"] += (f". vLLM's CPU attention declares only {', '.join(known)} (its kernel takes any other "
                                "value as the model's dtype) and the CPU platform does not check")
    return entry


def _check_passkeys_fit(tokenizer_dir: Path, context: int) -> None:
    """Before any engine starts: the long-context workload's pass-key prompts fit in its prompt length."""
    from kvfold.measure.passkey import passkey_prompts
    from kvfold.sources.tokenizer import load_tokenizer

    try:
        passkey_prompts(load_tokenizer(tokenizer_dir), context)
    except KVFoldError:
        raise KVFoldError(f"--long-prompt-tokens {context} is too short to hide a pass key in (the long-context "
                          "workload serves the pass-key prompts at that length too); give at least 512") from None


def round_figures(per_round: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, each round's tokens/s (per_round: name -> one run per round, the first round's full run
    first; a failed run {}), their ratios to the same round's original's and the ratios' median: the verdict a
    ratio near a target needs, where one engine's step time drifts from the next one's by more than the gap."""
    original = per_round["original"]
    out = {}
    for name, runs in per_round.items():
        figures: dict = {"vs_original": {}}
        for workload, key in SPEEDS:
            mine = [(r.get(workload) or {}).get(key) for r in runs]
            if all(x is None for x in mine):
                continue
            theirs = [(r.get(workload) or {}).get(key) for r in original]
            ratios = [round(a / b, 4) if a is not None and b else None for a, b in zip(mine, theirs, strict=True)]
            figures[key] = mine
            figures["vs_original"][key] = ratios
            measured = [x for x in ratios if x is not None]
            figures["vs_original"][f"{key}_median"] = round(statistics.median(measured), 4) if measured else None
        out[name] = figures
    return out


def _run_paired(models: dict[str, tuple[str, str]], tokenizer_dir: Path, kv_cache_bytes: int, dtype: str,
                eager: bool, context: int, steps: int) -> dict:
    """serve_paired.paired_decode in a process of its own, every engine inside it; {"error": why} when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "paired.json"
        spec.write_text(json.dumps({"models": models, "tokenizer_dir": str(tokenizer_dir), "dtype": dtype,
                                    "kv_cache_bytes": kv_cache_bytes, "eager": eager, "context": context,
                                    "steps": steps}))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        done = run_module("kvfold_bench", ["serve-paired", str(spec), str(out)], env=env)
        if done.returncode != 0 or not out.exists():
            return {"error": root_cause(done.stdout + done.stderr)}
        return json.loads(out.read_text())


def _paired(configs: dict, models: dict, tokenizer_dir: Path, budget: int, dtype: str, eager: bool, context: int,
            steps: int, workers: int) -> dict:
    """The paired decode of every configuration that runs, each one's figures into its entry as "paired_decode";
    the workload's description back (with why, where it did not run)."""
    shape = {"context": context, "counted_steps_per_configuration": steps, "block": BLOCK, "warmup": WARMUP,
             "how": "every configuration's engine in one process, one request each, taking turns of a block of decode "
                    "steps (the first of each block not counted, the order rotating); ms_per_step: the median "
                    "counted step; vs_original: the original's median step / this one's"}
    if workers > 1:
        return shape | {"runs": False, "reason": "tensor or pipeline parallelism: the engines' workers would be "
                                                 "processes of their own, not taking turns in one"}
    names = [name for name, c in configs.items() if c["runs"] and "error" not in c]
    log.info("serve: paired decode of %s, one process", ", ".join(names))
    wanted = {name: (models[name][0], models[name][1].get("kv_cache_dtype", "auto")) for name in names}
    figures = _run_paired(wanted, tokenizer_dir, budget, dtype, eager, context, steps)
    if "error" in figures:
        log.warning("serve: the paired decode failed: %s", figures["error"])
        return shape | {"runs": False, "reason": f"the paired run failed: {figures['error']}"}
    for name in names:
        configs[name]["paired_decode"] = figures[name]
    return shape | {"runs": True}


def bench_serve(exports: list[Path], against: str | None, kv_cache_mib: int, kv_dtypes: list[str],
                workload: Workload, dtype: str, eager: bool, tensor_parallel: int = 1,
                pipeline_parallel: int = 1, rounds: int = 1, paired_steps: int = 0) -> dict:
    for name in kv_dtypes:
        if name not in KV_DTYPES:
            raise KVFoldError(f"--kv-cache-dtype {name!r} is not one of vLLM 0.32's: {', '.join(KV_DTYPES)} (or none)")
    if dtype not in _BYTES:
        raise KVFoldError(f"--dtype must be one of {', '.join(_BYTES)}, got {dtype!r}")
    manifests = [Manifest.load(e) for e in exports]
    if len({m.source.weights_sha256 for m in manifests}) > 1:
        raise KVFoldError("the exports come from different models; compare exports of one model in one run")
    source = resolve_model(against or manifests[0].source.path)
    if workload.which in ("all", "long"):
        _check_passkeys_fit(source.path, workload.long_prompt_tokens)
    budget = kv_cache_mib << 20
    args = {"kv_cache_bytes": budget, **{k: v for k, v in asdict(workload).items() if k != "which"},
            "workload": workload.which, "dtype": dtype, "eager": eager, "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel}

    def one(label: str, model: str, extra: dict | None = None, reference=None, must_run: bool = True) -> dict:
        log.info("serve: %s in a fresh vLLM engine", label)
        run = _run(model, source.path, {**args, **(extra or {})}, reference)
        if must_run and "error" in run:
            raise KVFoldError(f"vLLM run of {model} failed: {run['error']}")
        return run

    # every configuration's model and extra arguments, for its first round and any later one
    export_names, original_path = _names(exports), str(source.path)
    models = {**{n: (str(e), {}) for n, e in zip(export_names, exports, strict=True)},
              "original": (original_path, {}), **{d: (original_path, {"kv_cache_dtype": d}) for d in kv_dtypes}}
    # the exports first: an export vLLM refuses ends the run before the long runs of the others
    exported = {name: one(name, *models[name]) for name in export_names}
    original = one("original", *models["original"])
    reference = original.pop("probe_run")
    original |= {"kind": "original", "format_bytes_per_token": _original_bytes_per_token(source.path, dtype)}
    configs = {"original": original}
    for (name, run), manifest in zip(exported.items(), manifests, strict=True):
        run["probe"] = agreement(run.pop("probe_run"), reference)
        configs[name] = _export_entry(run, manifest, original, budget, dtype)
    for kv_dtype in kv_dtypes:
        run = one(f"kv_cache_dtype={kv_dtype}", *models[kv_dtype], reference, False)
        run.pop("probe_run", None)
        configs[kv_dtype] = _dtype_entry(kv_dtype, run)
    for entry in configs.values():
        if "kv_blocks" in entry:
            entry |= capacity_figures(entry, original)
    if rounds > 1 and workload.which != "none":
        # the same engines again, in turn, tokens/s only: round r of every configuration before round r + 1 of any
        per_round = {name: [c] for name, c in configs.items() if c["runs"] and "error" not in c}
        for r in range(2, rounds + 1):
            for name in per_round:
                model, extra = models[name]
                run = one(f"{name}, round {r} of {rounds}", model, {**extra, "timing_only": True}, must_run=False)
                per_round[name].append({} if "error" in run else run)
        for name, figures in round_figures(per_round).items():
            configs[name]["rounds"] = figures
    shapes = {"which": workload.which, "probe": {
        "prompts": PROBE_PROMPTS, "prompt_tokens": PROBE_PROMPT_TOKENS, "greedy_tokens": PROBE_TOKENS,
        "against": "kv_cache_dtype=auto", "runs_if": f"top1_agreement >= {PROBE_MIN_TOP1} and ppl_ratio <= "
        f"{PROBE_MAX_PPL}"}}
    if workload.which in ("all", "limited"):
        tokens = workload.requests * (workload.prompt_tokens + workload.new_tokens)
        shapes["cache_limited"] = {"requests": workload.requests, "prompt_tokens": workload.prompt_tokens,
                                   "new_tokens": workload.new_tokens, "tokens": tokens,
                                   "limits_original": tokens > original["kv_token_capacity"]}
        if not shapes["cache_limited"]["limits_original"]:
            log.warning("serve: the original holds all %d tokens of the workload; raise --requests or lower "
                        "--kv-cache-mib for a cache-limited one", tokens)
    if workload.which in ("all", "long"):
        shapes["long_context"] = {"prompt_tokens": workload.long_prompt_tokens, "new_tokens": workload.long_new_tokens}
        if paired_steps > 0:
            shapes["paired_decode"] = _paired(configs, models, source.path, budget, dtype, eager,
                                              workload.long_prompt_tokens, paired_steps,
                                              tensor_parallel * pipeline_parallel)
    return {"benchmark": "serve", "engine": "vllm", "original": str(source.path), "dtype": dtype,
            "kv_cache_mib": kv_cache_mib, "kv_cache_memory_bytes": budget, "eager": eager, "rounds": rounds,
            "tensor_parallel_size": tensor_parallel, "pipeline_parallel_size": pipeline_parallel, "workloads": shapes,
            "configurations": configs}
