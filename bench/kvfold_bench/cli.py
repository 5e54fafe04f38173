"""`kvfold-bench frontier|kernels|calibrate|export|compile|memory|serve|openai|ttft ...` (also `python -m kvfold_bench
...`): each prints or writes JSON measured in that run. A console script of its own, beside the product's
`kvfold`: kvfold.cli never imports this package, and the compile benchmark runs `kvfold` as a child process.
Every command, the hidden per-process ones too, runs inside user_errors: bad input is one `error:` line, exit 2."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.logging import RichHandler

from kvfold.console import err, user_errors
from kvfold.errors import KVFoldError
from kvfold.io import atomic_write_text
from kvfold.sources.embedded import cache_root

# Each benchmark module (torch, transformers, vLLM) is imported inside its command, so --help answers at once.

app = typer.Typer(help="Benchmarks: every figure measured in the run, as JSON.", add_completion=False,
                  rich_markup_mode="markdown", pretty_exceptions_enable=False, no_args_is_help=True)


@app.callback()
def log_to_stderr() -> None:
    """The API's progress lines on stderr, as under `kvfold` (every command; callers of one command call it too)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=err, show_path=False)])


def _at_least_1(*flags: tuple[str, int]) -> None:
    for flag, value in flags:
        if value < 1:
            raise KVFoldError(f"{flag} must be at least 1, got {value}")


SERVER_DTYPE_HELP = ("vLLM's --dtype for both servers: auto (the server's default), float32, bfloat16 or float16 "
                     "(float32 on a CPU without native bfloat16, where bfloat16 runs several times slower).")


def _server_dtype(dtype: str) -> str | None:
    """--dtype as openai_server.serve_all takes it (None: the server's default)."""
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise KVFoldError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return None if dtype == "auto" else dtype


def _export_lengths(export: Path, lengths: str) -> list[int]:
    """The token counts of --lengths, once `export` is known to be an export."""
    from kvfold_runtime import MANIFEST

    if not (export / MANIFEST).is_file():
        raise KVFoldError(f"{export} is not a kvfold export (no {MANIFEST}); run kvfold export first")
    try:
        sizes = [int(x) for x in lengths.split(",")]
    except ValueError:
        raise KVFoldError(f"--lengths {lengths!r}: give token counts separated by commas, e.g. 4096,8192") from None
    _at_least_1(*((f"--lengths {n}", n) for n in sizes))
    return sizes


@app.command()
def frontier(
    model: Annotated[list[str] | None, typer.Option(help="Models to sweep, in order [smollm2, smollm2-mha].")] = None,
    method: Annotated[list[str] | None, typer.Option(help="Methods [all on the first model; kvfold and the "
                                                     "peers, no ablations, on the others].")] = None,
    accuracy: Annotated[float, typer.Option(help="The accuracy A the compression is read off at: top-1 ratio ≥ A "
                                            "(and, joint, perplexity ratio ≤ 1/A on every text).")] = 0.99,
    eval_text: Annotated[str, typer.Option(help="Held-out text every point is scored on; a mixture A+B is also "
                                           "scored per text.")] = "wiki:eval+pydoc:eval",
    eval_tokens: Annotated[int, typer.Option(help="Tokens of --eval-text (all texts together), in windows of "
                                             "--context.")] = 12288,
    context: Annotated[int, typer.Option(help="Window length every point is scored in (calibration stays at "
                                         "512).")] = 512,
    score_from: Annotated[int, typer.Option(help="Score each window's tokens from this position on (long context: "
                                            "e.g. --context 4096 --score-from 1024, so that a cache's recent "
                                            "window cannot hide its history's error).")] = 1,
    passkey: Annotated[int, typer.Option(help="Also passkey retrieval in prompts of this many tokens: the original's, "
                                         "and each method read as export reads its own: the smallest point at the "
                                         "joint target that keeps the keys under three roundings (0: skip).")] = 0,
    calib_tokens: Annotated[int, typer.Option(help="--calib-text tokens per calibration.")] = 8192,
    calib_text: Annotated[str, typer.Option(help="Text the calibrations read (a code model: "
                                            "wiki:calib+pysrc:calib, as its export's).")] = "wiki:calib",
    sensitivity_tokens: Annotated[int, typer.Option(help="wiki:dev tokens for kvfold's layer costs.")] = 512,
    multiple: Annotated[int, typer.Option(help="Round every rank up to a multiple of this (1: any width, as "
                                          "the HF runtime's packed cache takes; 8/16 for GPU kernels).")] = 1,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON here [stdout].")] = None,
    png: Annotated[Path | None, typer.Option(help="Draw top-1 ratio vs KV bytes here.")] = None,
) -> None:
    """Accuracy vs KV bytes per method (kvfold, ablations, ZACK/FDC, uniform, Palu, ThinK, fp8, kvfold+fp8,
    kvfold-bits, int8, int4, KIVI, and vLLM's own int8/fp8/int4_per_token_head and turboquant_* caches)."""
    from kvfold_bench.frontier import bench_frontier
    from kvfold_bench.tables import frontier_table

    with user_errors():
        report = bench_frontier(model or ["smollm2", "smollm2-mha"], method, accuracy, eval_text, eval_tokens,
                                calib_tokens, sensitivity_tokens, multiple, json_out, png, context=context,
                                passkey=passkey, calib_text=calib_text, score_from=score_from)
    err.print(frontier_table(report))
    if json_out is None:
        print(json.dumps(report, indent=2))


@app.command()
def kernels(
    export: Annotated[Path | None, typer.Option(help="Also time the median layer of this export's widths (with "
                                                "--aot: compile the page-layout decode for each of its kinds of "
                                                "head instead).")] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    reps: Annotated[int, typer.Option(help="Timed repetitions per point (median).")] = 20,
    smoke: Annotated[bool, typer.Option("--smoke", help="Tiny shapes on any device (CPU: TRITON_INTERPRET=1); "
                                        "checks the command, times nothing meaningful.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON here [stdout].")] = None,
    png: Annotated[Path | None, typer.Option(help="Draw time ratio vs p here.")] = None,
    aot: Annotated[str | None, typer.Option(help="Time nothing: compile each decode and prefill kernel (and vLLM's "
                                            "int4_per_token_head decode) for this GPU arch (sm_90) without a GPU "
                                            "and report SASS instructions per cached number, registers, spills, "
                                            "loads (kvfold_bench.aot).")] = None,
    graphs: Annotated[bool, typer.Option("--graphs", help="Also time the page-layout decode steps and SDPA "
                                         "replayed from CUDA graphs (vLLM's full CUDA-graph mode).")] = False,
) -> None:
    """GPU attention time: uncompressed torch SDPA vs kvfold's Triton kernels and torch path, decode B in {1, 16,
    64} x S in {4K, 32K} and prefill 4K/16K, rank layers (p = 0.25 / 0.5, Llama-3-8B shapes), bits layers in rows
    and pages, an export's widths. With --aot sm_90: the kernels' compiled code instead, on any machine."""
    from kvfold_bench.kernels import bench_kernels, draw
    from kvfold_bench.outputs import check_paths, write_outputs

    if aot is not None:
        from kvfold_bench.aot import aot_report, export_report

        with user_errors():
            check_paths(json_out)
            report = aot_report(aot) if export is None else export_report(export, aot)
            write_outputs(report, json_out, None, None)
        if json_out is None:
            print(json.dumps(report, indent=2))
        return
    with user_errors():
        check_paths(json_out, png)
        _at_least_1(("--reps", reps))
        if png is not None:
            from kvfold_bench.frontier.plot import pyplot

            pyplot()
        report = bench_kernels(export, dtype, smoke, reps, graphs)
        write_outputs(report, json_out, png, draw)
    if json_out is None:
        print(json.dumps(report, indent=2))


@app.command()
def calibrate(
    model: Annotated[str, typer.Option(help="Model folder or alias.")] = "smollm2",
    tokens: Annotated[list[int] | None, typer.Option(help="Token counts, one fresh process each.")] = None,
    source: Annotated[str, typer.Option(help="random or text.")] = "random",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 512,
    batch: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
) -> None:
    """Time calibration and measure its peak memory; print JSON."""
    from kvfold_bench.calibrate import bench_calibrate

    with user_errors():
        report = bench_calibrate(model, tokens or [4096, 16384], source, seq_len, batch)
    print(json.dumps(report, indent=2))


@app.command()
def export(
    model: Annotated[str, typer.Option(help="Model folder or alias.")] = "smollm2",
    accuracy: Annotated[float, typer.Option(help="The accuracy target A.")] = 0.99,
    metric: Annotated[str, typer.Option(help="joint (top-1 ≥ A and perplexity ≤ 1/A), top1, ppl or agree.")] = "joint",
    method: Annotated[list[str] | None, typer.Option(help="Factor methods to compare.")] = None,
    calib_tokens: Annotated[int, typer.Option(help="wiki:calib tokens to calibrate on.")] = 16384,
    eval_tokens: Annotated[int, typer.Option(help="wiki:dev tokens the search scores on.")] = 16384,
    heldout_tokens: Annotated[int, typer.Option(help="wiki:eval tokens for the held-out check.")] = 16384,
    margin: Annotated[float, typer.Option(help="Standard errors of margin in the search.")] = 1.0,
    multiple: Annotated[int, typer.Option(help="Round ranks up to a multiple of this.")] = 8,
    allocation: Annotated[str, typer.Option(help="sensitivity or eq6 (for kvfold's aware method).")] = "sensitivity",
) -> None:
    """Export with each method at the target; compression and held-out ratios side by side; JSON.
    zack is the papers' method as published: one removal rate for every head (eq6)."""
    from kvfold_bench.export import bench_export

    with user_errors():
        _at_least_1(("--calib-tokens", calib_tokens), ("--heldout-tokens", heldout_tokens))
        report = bench_export(model, accuracy, method or ["aware", "zack"], calib_tokens, eval_tokens,
                              heldout_tokens, margin, multiple, allocation, metric)
    print(json.dumps(report, indent=2))


@app.command()
def memory(
    export: Annotated[Path | None, typer.Option(help="An exported directory [the one scripts/demo.sh writes].")] = None,
    against: Annotated[str | None, typer.Option(help="The original model [the manifest's source].")] = None,
    context: Annotated[int, typer.Option(help="Prompt tokens (wiki:eval).")] = 4096,
    new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
    batch: Annotated[int, typer.Option(help="Sequences generated together.")] = 1,
) -> None:
    """Peak memory of greedy generation, exported vs original, each in a fresh process; JSON."""
    from kvfold_bench.memory import bench_memory

    export = export or cache_root() / "demo" / "SmolLM2-135M-kvfold"
    with user_errors():
        report = bench_memory(export, against, context, new_tokens, batch)
    print(json.dumps(report, indent=2))


@app.command()
def serve(
    export: Annotated[list[Path] | None, typer.Option(help="An exported directory; repeat to compare several "
                                                      "exports of one model [the one scripts/demo.sh writes].")] = None,
    against: Annotated[str | None, typer.Option(help="The original model [the manifest's source].")] = None,
    kv_cache_dtype: Annotated[list[str] | None, typer.Option(help="vLLM's own kv_cache_dtype values to run the "
                                                             "original with, repeatable; none: no such run "
                                                             "[fp8, fp8_e5m2, int8/fp8/int4_per_token_head, the four "
                                                             "turboquant_*].")] = None,
    kv_cache_mib: Annotated[int, typer.Option(help="KV cache budget given to vLLM for each configuration, "
                                              "MiB.")] = 512,
    workload: Annotated[str, typer.Option(help="all (cache-limited and long-context), limited, long, or none "
                                          "(KV capacity and the probe only: fast; a windowed export's capacity for "
                                          "requests as long as the long-context one's).")] = "all",
    requests: Annotated[int, typer.Option(help="Cache-limited workload: requests, submitted at once.")] = 64,
    prompt_tokens: Annotated[int, typer.Option(help="Cache-limited workload: prompt tokens per request "
                                               "(wiki:eval).")] = 512,
    new_tokens: Annotated[int, typer.Option(help="Cache-limited workload: tokens generated per request (greedy, "
                                            "EOS ignored).")] = 512,
    long_prompt_tokens: Annotated[int, typer.Option(help="Long-context workload: the one request's prompt "
                                                    "tokens.")] = 4096,
    long_new_tokens: Annotated[int, typer.Option(help="Long-context workload: its generated tokens (decode "
                                                 "tokens/s counts those after the first).")] = 128,
    dtype: Annotated[str, typer.Option(help="Model dtype in vLLM.")] = "float32",
    eager: Annotated[bool, typer.Option(help="Skip vLLM's torch.compile (faster start, slower steps).")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM's tensor-parallel size for every configuration "
                                                      "(--kv-cache-mib is then each rank's budget).")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="vLLM's pipeline-parallel size for every "
                                                        "configuration.")] = 1,
    rounds: Annotated[int, typer.Option(help="Run every configuration this many times, one after another in "
                                        "turn, and report each speed ratio to the original per round and its "
                                        "median (rounds after the first: tokens/s only, no probe or pass keys). "
                                        "Engines drift from one to the next; one round does not separate "
                                        "0.95× from 0.9×.")] = 1,
    paired_steps: Annotated[int, typer.Option(help="Then time batch-1 decode at the long context with every "
                                              "configuration that runs in one process, the engines taking turns "
                                              "(counted steps each; 0: not run): a decode ratio the drift between "
                                              "engines does not blur.")] = 128,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the JSON here.")] = None,
    png: Annotated[Path | None, typer.Option(help="Draw KV capacity and tokens/s per configuration here.")] = None,
) -> None:
    """vLLM serving at one KV budget: the original, each export, and the original under each of vLLM's own
    kv_cache_dtype values, each in a fresh process. Per configuration: vLLM's KV blocks, token capacity and
    bytes per token, their ratios to the original's, a probe against kv_cache_dtype=auto (2 prompts read
    teacher-forced, then 16 greedy tokens: a built-in dtype whose cache is not read back as written, or whose
    engine fails, is `"runs": false` with why, and no throughput), then tokens/s of a cache-limited workload
    (peak running requests and preemptions too) and decode tokens/s of one long request; then every configuration
    that runs decodes that long request again, all in one process taking turns (--paired-steps): the decode ratio
    to the original that engines started one after another cannot give on a busy machine; JSON.

    The defaults make the cache the limit of the original: 64 × (512 + 512) = 65,536 tokens against the
    11,648 that SmolLM2-135M's float32 cache holds in 512 MiB (the JSON's `limits_original` says so for any
    model and budget)."""
    from kvfold_bench.outputs import check_paths, write_outputs
    from kvfold_bench.serve import DEFAULT_KV_DTYPES, bench_serve
    from kvfold_bench.serve_point import Workload
    from kvfold_bench.serve_view import draw, serve_table

    with user_errors():
        check_paths(json_out, png)
        _at_least_1(("--kv-cache-mib", kv_cache_mib), ("--tensor-parallel-size", tensor_parallel_size),
                    ("--pipeline-parallel-size", pipeline_parallel_size), ("--rounds", rounds))
        if paired_steps < 0:
            raise KVFoldError(f"--paired-steps must be 0 (not run) or more, got {paired_steps}")
        shape = Workload(requests, prompt_tokens, new_tokens, long_prompt_tokens, long_new_tokens, workload)
        if png is not None:
            from kvfold_bench.frontier.plot import pyplot

            pyplot()
        dtypes = list(DEFAULT_KV_DTYPES) if kv_cache_dtype is None else [d for d in kv_cache_dtype if d != "none"]
        report = bench_serve(export or [cache_root() / "demo" / "SmolLM2-135M-kvfold"], against, kv_cache_mib,
                             dtypes, shape, dtype, eager, tensor_parallel_size, pipeline_parallel_size, rounds,
                             paired_steps)
        write_outputs(report, json_out, png, draw)
    err.print(serve_table(report))
    print(json.dumps(report, indent=2))


@app.command()
def openai(
    export: Annotated[Path | None, typer.Option(help="An exported directory [the one scripts/demo.sh writes].")] = None,
    prompt: Annotated[str, typer.Option(help="The completion prompt.")] = "The capital of France is",
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer.")] = 16,
) -> None:
    """vLLM's OpenAI-compatible server on the export (127.0.0.1, a free port): one /v1/completions and one
    /v1/chat/completions, then stopped; JSON with the answers and the seconds each step took."""
    from kvfold_bench.openai_server import ask_server
    from kvfold_runtime import MANIFEST

    export = export or cache_root() / "demo" / "SmolLM2-135M-kvfold"
    with user_errors():
        _at_least_1(("--max-tokens", max_tokens))
        if not (export / MANIFEST).is_file():
            raise KVFoldError(f"{export} is not a kvfold export (no {MANIFEST}); run kvfold export first")
        print(json.dumps(ask_server(export, prompt, max_tokens), indent=2))


@app.command()
def ttft(
    export: Annotated[Path | None, typer.Option(help="An exported directory [the one scripts/demo.sh writes].")] = None,
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens, comma-separated (each plus the one "
                                         "answer token within the model's context).")] = "4096,8191",
    requests: Annotated[int, typer.Option(help="Requests per length and server (median).")] = 20,
    text: Annotated[str, typer.Option(help="The text the prompts are windows of.")] = "wiki:eval+pysrc:eval",
    dtype: Annotated[str, typer.Option(help=SERVER_DTYPE_HELP)] = "auto",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON here [stdout].")] = None,
) -> None:
    """Time to first token through vLLM's OpenAI server: the export and its original served at once, taking turns,
    prompts of real text at each length (max_tokens=1); medians and the export's ratio; JSON."""
    from kvfold.checkpoint.manifest import Manifest
    from kvfold_bench.outputs import write_outputs
    from kvfold_bench.ttft import ttft as bench_ttft

    export = export or cache_root() / "demo" / "SmolLM2-135M-kvfold"
    with user_errors():
        _at_least_1(("--requests", requests))
        server_dtype = _server_dtype(dtype)
        sizes = _export_lengths(export, lengths)
        report = bench_ttft(export, Path(Manifest.load(export).source.path), sizes, requests, text, dtype=server_dtype)
        write_outputs(report, json_out, None, None)
    print(json.dumps(report, indent=2))


@app.command()
def ruler(
    export: Annotated[Path | None, typer.Option(help="An exported directory [the one scripts/demo.sh writes].")] = None,
    task: Annotated[list[str] | None, typer.Option(help="RULER tasks that run offline [niah_single_1, niah_multikey_2, "
                                                  "niah_multikey_3, ruler_vt, ruler_cwe, ruler_fwe].")] = None,
    lengths: Annotated[str, typer.Option(help="Context lengths, comma-separated (within the model's).")] = "4096",
    samples: Annotated[int, typer.Option(help="Samples per task and length (RULER's own, the first N).")] = 20,
    dtype: Annotated[str, typer.Option(help=SERVER_DTYPE_HELP)] = "auto",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON here, and resume from it when it "
                                                  "holds part of the same run [stdout].")] = None,
    only: Annotated[str | None, typer.Option(help="original or export: that model alone (a screen) [both].")] = None,
) -> None:
    """RULER (lm-eval) on an export and its original through vLLM's OpenAI server, in points; JSON, resumable."""
    from kvfold.checkpoint.manifest import Manifest
    from kvfold_bench.outputs import check_paths
    from kvfold_bench.ruler import OFFLINE_TASKS
    from kvfold_bench.ruler import ruler as bench_ruler

    export = export or cache_root() / "demo" / "SmolLM2-135M-kvfold"
    with user_errors():
        _at_least_1(("--samples", samples))
        if only not in (None, "original", "export"):
            raise KVFoldError(f"--only must be original or export, got '{only}'")
        server_dtype = _server_dtype(dtype)
        sizes = _export_lengths(export, lengths)
        if json_out is not None:
            check_paths(json_out)
        report = bench_ruler(export, Path(Manifest.load(export).source.path), list(task or OFFLINE_TASKS), sizes,
                             samples, json_out, dtype=server_dtype, only=only)
    print(json.dumps(report, indent=2))


@app.command()
def compile(  # the command's name
    shape: Annotated[str, typer.Option(help="smollm2 or qwen2.5-coder-1.5b (real weights), llama3-8b or qwen2-7b "
                                       "(exact configs, seeded random weights), or any MODEL (a folder or Hub id "
                                       "org/name[@revision], real weights).")] = "smollm2",
    fmt: Annotated[str, typer.Option("--format", help="The export's format: rank or bits.")] = "rank",
    device: Annotated[str, typer.Option(help="auto (CUDA when torch sees one), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Model dtype while calibrating and searching.")] = "bfloat16",
    verify_dtype: Annotated[str | None, typer.Option(help="Dtype of both models in verify [--dtype].")] = None,
    tokens: Annotated[int, typer.Option(help="Calibration tokens, search tokens and verify tokens per text.")] = 16384,
    search_steps: Annotated[int | None, typer.Option(help="The export's --search-steps [its default]: fewer "
                                                     "candidates, the same peak memory.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON here [stdout].")] = None,
) -> None:
    """The whole compile (calibrate → export → verify), each stage its own process: seconds, peak RSS and peak
    CUDA memory per stage, JSON."""
    from kvfold_bench.compile import bench_compile

    with user_errors():
        report = bench_compile(shape, device, dtype, verify_dtype or dtype, tokens, fmt, search_steps)
    text = json.dumps(report, indent=2)
    if json_out is not None:
        atomic_write_text(json_out, text + "\n")
    print(text)


# the hidden commands the benches run in child processes register themselves on `app`
from kvfold_bench import cli_children  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":
    main()
