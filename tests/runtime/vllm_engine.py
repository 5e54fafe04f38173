"""Run one real vLLM engine in a process of its own and read back what it did (tests call `run_engine`).

A process per engine: vLLM starts its own engine and worker processes and does not free everything when an LLM
object goes away, and a failed start must not take the test process with it. The process is forked from kvfold's
engine host (bench/kvfold_bench/engine_host.py), which imported vLLM once for the whole test run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from kvfold_bench.engine_host import run_module
from kvfold_bench.serve_point import cpu_threads_bind

REPO = Path(__file__).resolve().parents[2]
# vLLM's engine core (and one worker) in the engine's own process: vLLM's CPU platform starts each process of its own
# by spawning, which imports vLLM again (~12 s each here; 25 s of a tiny engine's 31 s start). The tests of
# `kvfold-bench serve` set it too: they read the bench's mechanics and arithmetic, which do not depend on it; the
# bench, as users run it, keeps vLLM's default.
ENGINE_IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_engine(model: Path | str, prompts: list[list[int]], *, max_tokens: int = 32, kv_cache_bytes: int = 8 << 20,
               block_size: int | None = None, max_model_len: int = 256, plugins: str | None = None,
               kv_cache_dtype: str = "auto", timeout: int = 600, tensor_parallel: int = 1, pipeline_parallel: int = 1,
               eager: bool = True, env: dict | None = None, own_processes: bool = False,
               logprobs: int | None = None, engine_args: dict | None = None) -> dict:
    """Greedy generation from vLLM, exactly `max_tokens` per prompt (EOS does not stop it; the tiny models'
    tokenizer and generation config name different EOS tokens): {"tokens", "kv_blocks", "block_size",
    "max_concurrency" (vLLM's: requests of max_model_len tokens its pool holds at once, every cache group counted)},
    {"error": last lines, "output": everything printed} when the engine failed to start or run. With several
    workers (tensor/pipeline parallel, vLLM's multiprocessing executor) each gets its own share of this process's
    cores (VLLM_CPU_OMP_THREADS_BIND: the CPU build's automatic binding wants a NUMA node per worker). `eager`:
    vLLM's enforce_eager (False: compiled, as vLLM serves by default). `own_processes`: the engine core in a process
    of its own, as `vllm serve` runs it (a refusal is then the engine core's ERROR line); by default it runs in this
    one process (ENGINE_IN_PROCESS), and so does one worker; several workers have their own (spawned) processes
    either way. `logprobs`: also {"logprobs": per prompt, per generated token, {token id: log-probability}} of
    that step's `logprobs` most likely tokens (vLLM's SamplingParams.logprobs; the chosen token is among them).
    `engine_args`: more of vLLM's LLM arguments (e.g. enable_prefix_caching)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "kv_cache_bytes": kv_cache_bytes,
                "block_size": block_size, "max_model_len": max_model_len, "kv_cache_dtype": kv_cache_dtype,
                "tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel, "eager": eager,
                "logprobs": logprobs, "engine_args": engine_args or {}, "out": str(out)}
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        workers = tensor_parallel * pipeline_parallel
        if not own_processes:
            env |= ENGINE_IN_PROCESS
        if workers > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(workers)
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins  # vLLM loads only the general plugins named here
        done = run_module("tests.runtime.vllm_engine", [json.dumps(args)], cwd=REPO, env=env, timeout=timeout)
        output = done.stdout + done.stderr
        if done.returncode == 0 and out.exists():
            got = json.loads(out.read_text())
            if "logprobs" in got:  # JSON made the token ids strings
                got["logprobs"] = [[{int(t): lp for t, lp in step.items()} for step in steps]
                                   for steps in got["logprobs"]]
            return {**got, "output": output}
        return {"error": output.strip().splitlines()[-5:], "output": output}


def _main(args: dict) -> None:
    from vllm import LLM, SamplingParams

    extra = ({"block_size": args["block_size"]} if args["block_size"] else {}) | args["engine_args"]
    if args["tensor_parallel"] * args["pipeline_parallel"] > 1:
        extra |= {"tensor_parallel_size": args["tensor_parallel"], "pipeline_parallel_size": args["pipeline_parallel"],
                  "distributed_executor_backend": "mp"}
    llm = LLM(model=args["model"], dtype="float32", enforce_eager=args["eager"], max_model_len=args["max_model_len"],
              kv_cache_memory_bytes=args["kv_cache_bytes"], kv_cache_dtype=args["kv_cache_dtype"], seed=0, **extra)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]],
                        SamplingParams(max_tokens=args["max_tokens"], temperature=0, ignore_eos=True,
                                       logprobs=args["logprobs"]), use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "kv_blocks": cache.num_gpu_blocks,
              "block_size": cache.block_size, "max_concurrency": cache.kv_cache_max_concurrency}
    if args["logprobs"]:
        result["logprobs"] = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                              for o in outs]
    Path(args["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
