"""One configuration of `kvfold-bench serve`, in the process that runs it (the hidden `serve-point` command):
one vLLM engine with the given KV budget and `kv_cache_dtype`, then, on that engine,

- the probe: PROBE_PROMPTS wiki:eval prompts of PROBE_PROMPT_TOKENS tokens, read with their next-token
  log-probabilities (vLLM's CPU attention reads prefill's keys and values back from the cache too), then
  PROBE_TOKENS greedy tokens each. Given the original's probe at kv_cache_dtype="auto" (`reference`), a
  configuration whose cache is not read back as written (`reads_back`) stops here: its throughput would
  be the speed of a wrong answer;
- the cache-limited workload: N requests of P prompt + G new tokens, all submitted at once, with the
  peak running / waiting requests and KV use read through a stat logger (vLLM's public metrics hook);
- the long-context workload: one request of LP prompt + LG new tokens, its prefill time and its decode
  tokens/s (tokens after the first ÷ the time after the first); then the pass keys at LP tokens
  (kvfold.measure.passkey's 10 prompts, submitted at once): how many the engine's greedy answer retrieves.

Greedy, EOS ignored, prefix caching off (no workload reuses another's blocks).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.measure.passkey import passkey_prompts, passkey_summary
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer

__all__ = ["PROBE_MAX_PPL", "PROBE_MIN_TOP1", "PROBE_PROMPTS", "PROBE_PROMPT_TOKENS", "PROBE_TOKENS", "WORKLOADS",
           "Workload", "agreement", "one_engine", "reads_back", "wiki_eval_ids"]

PROBE_PROMPTS, PROBE_PROMPT_TOKENS, PROBE_TOKENS = 2, 256, 16
# Far from both sides of what was measured (SmolLM2-135M, float32, top-1 agreement / perplexity ratio): fp8
# 0.918 / 1.006, fp8_e5m2 0.851 / 1.067; the 1-byte caches the CPU kernel reads as float32 0.016 / 53,360.
PROBE_MIN_TOP1, PROBE_MAX_PPL = 0.5, 2.0
WORKLOADS = ("all", "limited", "long", "none")  # none: capacity and probe only


@dataclass(frozen=True)
class Workload:
    """What each engine runs after its probe: `which` of WORKLOADS (all = the cache-limited one of
    `requests` × (`prompt_tokens` + `new_tokens`) and the long-context one of `long_prompt_tokens` +
    `long_new_tokens`; none = capacity and probe only)."""
    requests: int = 64
    prompt_tokens: int = 512
    new_tokens: int = 512
    long_prompt_tokens: int = 4096
    long_new_tokens: int = 128
    which: str = "all"

    def __post_init__(self) -> None:
        if self.which not in WORKLOADS:
            raise KVFoldError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.which!r}")
        for name, value in asdict(self).items():
            if name != "which" and value < 1:
                raise KVFoldError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.long_new_tokens < 2 and self.which in ("all", "long"):
            raise KVFoldError("--long-new-tokens must be at least 2 (decode tokens/s counts those after the first)")


def agreement(probe: dict, reference: dict) -> dict:
    """How a probe compares with the reference's (kv_cache_dtype="auto"): its greedy tokens (equal position
    by position; per prompt the first that differs, None when all agree) and, reading the same prompts
    (teacher-forced), its top-1 next-token agreement and its perplexity ratio ppl / ppl_auto."""
    pairs = list(zip(probe["tokens"], reference["tokens"], strict=True))
    same = sum(a == b for got, ref in pairs for a, b in zip(got, ref, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None) for got, ref in pairs]
    top1 = [a == b for got, ref in zip(probe["top1"], reference["top1"], strict=True)
            for a, b in zip(got, ref, strict=True)]
    nll = [x for row in probe["nll"] for x in row]
    ref_nll = [x for row in reference["nll"] for x in row]
    return {"greedy_tokens_equal": same, "greedy_tokens": sum(len(ref) for _, ref in pairs),
            "first_difference": first, "top1_agreement": round(sum(top1) / len(top1), 4),
            "ppl_ratio": round(math.exp(sum(nll) / len(nll) - sum(ref_nll) / len(ref_nll)), 4)}


def reads_back(probe: dict) -> bool:
    """Whether a cache reads back what was written, up to its rounding: teacher-forced top-1 agreement with
    auto at least PROBE_MIN_TOP1 and perplexity ratio at most PROBE_MAX_PPL. Greedy tokens alone are no test:
    fp8's rounding sends SmolLM2's greedy text down another, equally fluent, path within 2 tokens (18 of 32
    tokens equal), while a cache read as the wrong dtype differs from the first token."""
    return probe["top1_agreement"] >= PROBE_MIN_TOP1 and probe["ppl_ratio"] <= PROBE_MAX_PPL


def _cpu_cache_dtypes() -> list[str] | None:
    """The cache dtypes vLLM's CPU attention backend declares (None off CPU); the CPU platform never checks a
    kv_cache_dtype against them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.supported_kv_cache_dtypes)


def wiki_eval_ids(tokenizer_dir: Path, need: int) -> list[int]:
    ids = load_tokenizer(tokenizer_dir)("\n\n".join(resolve_text("wiki:eval"))).input_ids
    if len(ids) < need:
        raise KVFoldError(f"wiki:eval has {len(ids)} tokens, fewer than the {need} the workloads ask for; "
                          "lower --requests, --prompt-tokens or --long-prompt-tokens")
    return ids


def _drive(engine, prompts: list[list[int]], params) -> dict:
    """Submit every prompt at once and step the engine until all finish: generated tokens, each request's
    token ids, wall time, and (for one request) when its first token came."""
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    first, done = None, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs[0].token_ids:
                first = time.perf_counter()
            if o.finished:
                done[int(o.request_id)] = o
    end = time.perf_counter()
    outs = [done[i] for i in range(len(prompts))]
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "outputs": outs, "seconds": end - t0,
            "first_token_s": (first or end) - t0, "after_first_s": end - (first or end)}


def cpu_threads_bind(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: this process's cores in contiguous sets, "0,1|2,3" (a
    core serves two workers when there are fewer cores than workers). vLLM's CPU build binds each worker to a NUMA
    node by default and refuses more workers than nodes ("Not enough allowed NUMA nodes"); one node here."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // workers)
    sets = [cores[(i * per) % len(cores):(i * per) % len(cores) + per] for i in range(workers)]
    return "|".join(",".join(map(str, s)) for s in sets)


def one_engine(model: str, tokenizer_dir: str, kv_cache_bytes: int, kv_cache_dtype: str, shape: Workload,
               dtype: str, eager: bool, reference: dict | None = None, tensor_parallel: int = 1,
               pipeline_parallel: int = 1, timing_only: bool = False) -> dict:
    """In this process: one engine, its KV capacity, the probe, then the workloads `shape` names; `reference`:
    the original's probe at kv_cache_dtype="auto" (its "probe_run"). With tensor or pipeline parallelism the
    engine's workers are vLLM's multiprocessing executor's, and kv_cache_bytes is each worker's budget.
    `timing_only`: the workloads' tokens/s alone, no probe and no pass keys (a repeated round of
    `kvfold-bench serve --rounds`, whose first round read them)."""
    if not (Path(model) / "config.json").is_file():
        raise KVFoldError(f"model folder '{model}' does not exist or has no config.json")
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.v1.metrics.loggers import StatLoggerBase

    limited, long = shape.which in ("all", "limited"), shape.which in ("all", "long")
    requests, prompt_tokens, new_tokens = shape.requests, shape.prompt_tokens, shape.new_tokens
    long_prompt_tokens, long_new_tokens = shape.long_prompt_tokens, shape.long_new_tokens
    peaks = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0}

    class Peaks(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                peaks["running"] = max(peaks["running"], scheduler_stats.num_running_reqs)
                peaks["waiting"] = max(peaks["waiting"], scheduler_stats.num_waiting_reqs)
                peaks["kv_usage"] = max(peaks["kv_usage"], scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:  # running requests sent back to wait for blocks (recomputed later)
                peaks["preemptions"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            pass

    # the probe's prompts shortened to the model's positions (tiny test models have 256)
    positions = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    probe_len = min(PROBE_PROMPT_TOKENS, (positions or PROBE_PROMPT_TOKENS + PROBE_TOKENS) - PROBE_TOKENS)
    workload_tokens = requests * prompt_tokens * limited
    need = max(workload_tokens, long_prompt_tokens * long) + PROBE_PROMPTS * probe_len
    ids = wiki_eval_ids(Path(tokenizer_dir), need)
    probe = [ids[len(ids) - (i + 1) * probe_len:][:probe_len] for i in range(PROBE_PROMPTS)]  # the text's end
    max_len = max(probe_len + PROBE_TOKENS, (prompt_tokens + new_tokens) * limited,
                  (long_prompt_tokens + max(long_new_tokens, 16)) * long)  # 16: room for a pass key's answer
    # a windowed bits export's rings take pool blocks per request (kvfold_runtime.vllm.ring): its capacity is vLLM's
    # own group-aware count of tokens in requests of max_len (what it logs as "KV cache size"), stated for requests of
    # the long-context one's length even with no workload
    block = json.loads((Path(model) / "config.json").read_text()).get("kvfold", {})
    windowed = bool(block.get("sinks") or block.get("window"))
    if windowed and shape.which == "none":
        max_len = max(max_len, min(long_prompt_tokens + long_new_tokens, positions or max_len))
    parallel = {}
    if tensor_parallel * pipeline_parallel > 1:
        parallel = {"tensor_parallel_size": tensor_parallel, "pipeline_parallel_size": pipeline_parallel,
                    "distributed_executor_backend": "mp"}
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype,
                   enforce_eager=eager, max_model_len=max_len, enable_prefix_caching=False,
                   disable_log_stats=False, seed=0, **parallel),
        stat_loggers=[Peaks])
    cache = engine.vllm_config.cache_config
    out = {"model": model, "kv_cache_dtype": kv_cache_dtype, "kv_cache_memory_bytes": kv_cache_bytes,
           "tensor_parallel_size": tensor_parallel, "pipeline_parallel_size": pipeline_parallel,
           "kv_blocks": cache.num_gpu_blocks, "block_size": cache.block_size, "max_model_len": max_len,
           "kv_token_capacity": cache.kv_cache_size_tokens if windowed else cache.num_gpu_blocks * cache.block_size,
           "startup_s": round(time.perf_counter() - t0, 1)}
    if kv_cache_dtype != "auto":
        out["cpu_attention_cache_dtypes"] = _cpu_cache_dtypes()

    def greedy(n: int, **more):
        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0, **more)

    out["runs"] = True
    if not timing_only:
        run = _drive(engine, probe, greedy(PROBE_TOKENS, prompt_logprobs=1))
        out["probe_run"] = {"tokens": run["tokens"], "top1": [], "nll": []}
        for o, prompt in zip(run["outputs"], probe, strict=True):  # position 0 has no prediction
            steps = o.prompt_logprobs[1:]
            out["probe_run"]["top1"].append([next(t for t, lp in s.items() if lp.rank == 1) for s in steps])
            out["probe_run"]["nll"].append([-s[t].logprob for s, t in zip(steps, prompt[1:], strict=True)])
    if reference is not None and not timing_only:
        out["probe"] = agreement(out["probe_run"], reference)
        if not reads_back(out["probe"]):
            return {**out, "runs": False}
    if limited:
        peaks.update(running=0, waiting=0, kv_usage=0.0, preemptions=0)
        prompts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(requests)]
        run = _drive(engine, prompts, greedy(new_tokens))
        generated = sum(map(len, run["tokens"]))
        out["cache_limited"] = {
            "seconds": round(run["seconds"], 2), "generated_tokens": generated,
            "generated_tokens_per_s": round(generated / run["seconds"], 2),
            "total_tokens_per_s": round((generated + requests * prompt_tokens) / run["seconds"], 2),
            "peak_running_requests": peaks["running"], "peak_waiting_requests": peaks["waiting"],
            "peak_kv_cache_usage": round(peaks["kv_usage"], 4), "preemptions": peaks["preemptions"]}
    if long:
        run = _drive(engine, [ids[:long_prompt_tokens]], greedy(long_new_tokens))
        decoded = len(run["tokens"][0]) - 1
        out["long_context"] = {
            "prefill_s": round(run["first_token_s"], 2), "decode_s": round(run["after_first_s"], 2),
            "decode_tokens": decoded,
            "decode_tokens_per_s": round(decoded / run["after_first_s"], 2) if run["after_first_s"] > 0 else None}
        if not timing_only:
            out["long_context"]["passkeys"] = _passkeys(engine, Path(tokenizer_dir), long_prompt_tokens, greedy)
    return out


def _passkeys(engine, tokenizer_dir: Path, context: int, greedy) -> dict:
    """The pass-key prompts of `context` tokens, served: a key is retrieved when the greedy answer's first
    tokens are its tokens (what verify's one-pass check scores, here from the engine's own cache)."""
    prompts = passkey_prompts(load_tokenizer(tokenizer_dir), context)  # checked to fit by bench_serve
    run = _drive(engine, [p.ids[:-p.answer].tolist() for p in prompts], greedy(max(p.answer for p in prompts)))
    hits = [got[:p.answer] == p.ids[-p.answer:].tolist() for got, p in zip(run["tokens"], prompts, strict=True)]
    return passkey_summary(prompts, hits)
