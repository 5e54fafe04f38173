"""`kvfold-bench kernels`: attention time of one layer, uncompressed torch SDPA vs kvfold's Triton kernels vs
kvfold's torch path, on the same contexts (issue 11's table).

Layers: Llama-3-8B's shapes (32 query / 8 KV heads, head_dim 128) compressed to p = 0.25 and 0.5 with every
head at the same width ("uniform") or at seeded uneven, unaligned widths of the same total ("uneven"), and
the widths of a real export's median layer (`--export`). Bits-format layers (every dim kept, band codes: 4 bits
everywhere, and a mix of 8/5/4-bit keys and 6/4-bit values) time kvfold's Triton bits kernel, which reads the codes
and dequantizes in registers. Decode: one new token per sequence, batch B × context S; prefill: one causal sequence
of T tokens. Times are CUDA-event medians; each ratio is to SDPA's
time on the same shape in the same run, next to the ideal 1 − p (the bytes a decode reads) or the FLOP ratio
(prefill). `--smoke` runs tiny shapes on any device (the kernels in Triton's interpreter on CPU): it checks
the command, its figures mean nothing.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kvfold
from kvfold.errors import KVFoldError
from kvfold_bench.kernel_steps import PAGE, graphed, paged_step, windowed_step
from kvfold_runtime import MANIFEST, LayerDims, head_dim, model_dims
from kvfold_runtime.pages import aligned

__all__ = ["LayerWidths", "bench_kernels", "synthetic_layer"]

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
DECODE = [(1, 4096), (1, 32768), (16, 4096), (16, 32768), (64, 4096), (64, 32768)]
PREFILL = [4096, 16384]
SMOKE_DECODE, SMOKE_PREFILL = [(2, 96)], [48]


@dataclass(frozen=True)
class LayerWidths:
    name: str
    head_dim: int
    dims: LayerDims  # the runtime's: widths per KV head, group, bytes per cached token

    @classmethod
    def of(cls, name: str, num_heads: int, head_dim: int, d_k: list[int], d_v: list[int]) -> LayerWidths:
        return cls(name, head_dim, LayerDims(tuple(d_k), tuple(d_v), num_heads // len(d_k)))

    @property
    def num_heads(self) -> int:
        return self.dims.group * self.dims.num_kv_heads

    @property
    def group(self) -> int:
        return self.dims.group

    @property
    def d_k(self) -> list[int]:
        return list(self.dims.d_k)

    @property
    def d_v(self) -> list[int]:
        return list(self.dims.d_v)

    @property
    def p(self) -> float:
        """Compression of this layer's cache: 1 − its row / the uncompressed row (2·G·d numbers; a bits layer's
        bytes against 16-bit numbers)."""
        size = 2 if self.dims.banded else 1
        return 1 - sum(self.dims.row_bytes(element_size=1)) / (2 * self.dims.num_kv_heads * self.head_dim * size)

    @property
    def flop_ratio(self) -> float:
        """Attention FLOPs vs uncompressed: Σ_h (d_k + d_v) / (2·H·d)."""
        return self.group * (sum(self.d_k) + sum(self.d_v)) / (2 * self.num_heads * self.head_dim)


def synthetic_layer(p: float, uneven: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                    seed: int = 0) -> LayerWidths:
    """Widths keeping 1 − p of a layer: equal, or seeded log-normal shares of the same total (unaligned,
    each in [1, head_dim]), keys and values drawn separately — the spread kvfold's exports show."""
    total = round((1 - p) * num_kv_heads * head_dim)
    if not uneven:
        w = [total // num_kv_heads] * num_kv_heads
        return LayerWidths.of(f"uniform p={p:g}", num_heads, head_dim, w, list(w))
    gen = torch.Generator().manual_seed(seed)

    def draw() -> list[int]:
        share = torch.exp(torch.randn(num_kv_heads, generator=gen) * 0.5)
        w = [min(head_dim, max(1, round(float(x)))) for x in share / share.sum() * total]
        i = 0
        while sum(w) != total:  # fix rounding one unit at a time, inside [1, head_dim]
            g = i % num_kv_heads
            step = 1 if sum(w) < total else -1
            if 1 <= w[g] + step <= head_dim:
                w[g] += step
            i += 1
        return w

    return LayerWidths.of(f"uneven p={p:g}", num_heads, head_dim, draw(), draw())


def bits_layer(name: str, k_runs: list[tuple[int, int]], v_runs: list[tuple[int, int]], num_heads: int,
               num_kv_heads: int, head_dim: int) -> LayerWidths:
    """Every dim of every head kept, coded in bands: runs of (bits, dims) for keys and values, each summing to
    head_dim, the same for every KV head, scales in the format kvfold writes."""
    from kvfold_runtime import bands_from_bits

    def bands(runs):
        bits = [b for b, n in runs for _ in range(n)]
        assert len(bits) == head_dim, (runs, head_dim)
        return tuple(bands_from_bits(bits) for _ in range(num_kv_heads))

    full = (head_dim,) * num_kv_heads
    return LayerWidths(name, head_dim, LayerDims(full, full, num_heads // num_kv_heads, bands(k_runs), bands(v_runs)))


def _bits_layers(head_dim: int, **shape) -> list[LayerWidths]:
    """4 bits everywhere, and a mix like an export's at ~0.3 of fp16 (wider codes on the first dims), its bands on
    16-dim chunks as export aligns them (at head_dim 128: an eighth, three eighths, a half | a quarter, the rest)."""
    e = max(16, head_dim // 8)
    return [bits_layer("bits 4", [(4, head_dim)], [(4, head_dim)], head_dim=head_dim, **shape),
            bits_layer("bits 8/5/4 | 6/4", [(8, e), (5, head_dim // 2 - e), (4, head_dim // 2)],
                       [(6, 2 * e), (4, head_dim - 2 * e)], head_dim=head_dim, **shape)]


def _pages(layer: LayerWidths, b: int, s: int, device, gen) -> tuple:
    """A paged cache in the GPU page layout (kvfold_runtime.pages) holding b sequences of s tokens in pages of
    PAGE tokens, full size (every token its own bytes, as a real cache is read), with its block table, seq_lens
    and query_start_loc for b one-token queries. Its pages repeat up to 256 distinct ones (made by the encoder)."""
    from kvfold_runtime.pages import page_layout

    layout = page_layout(layer.dims, PAGE)
    k_rows, v_rows = _bits_rows(layer, 1, min(b * s, 256 * PAGE), device, gen)
    distinct = layout.to_page(torch.cat([k_rows, v_rows], -1).view(-1, PAGE, layout.row_bytes))
    blocks = b * -(-s // PAGE)
    kv = distinct.repeat(-(-blocks // distinct.shape[0]), 1)[:blocks].reshape(blocks, 1, PAGE, -1).contiguous()
    table = torch.arange(blocks, dtype=torch.int32, device=device).view(b, -1)
    return (kv, table, torch.full((b,), s, dtype=torch.int32, device=device),
            torch.arange(b + 1, dtype=torch.int32, device=device))


def _bits_rows(layer: LayerWidths, b: int, s: int, device, gen) -> tuple:
    """Random keys/values of the layer's widths encoded into its band rows [B, S, bytes] (uint8). At most 4,096
    distinct tokens are encoded and then tiled (the encoder unpacks bit by bit: 64 × 32K tokens would need tens
    of GB); the kernel's time does not depend on which codes it reads."""
    from kvfold_runtime import encode_band_rows

    d = layer.dims
    n = min(b * s, 4096)
    rows = []
    for widths, bands in ((d.d_k, d.k_bands), (d.d_v, d.v_bands)):
        x = torch.randn(n, sum(widths), generator=gen, device=device, dtype=torch.float32)
        codes = encode_band_rows(x, widths, bands)
        rows.append(codes.repeat(-(-b * s // n), 1)[: b * s].reshape(b, s, -1).contiguous())
    return tuple(rows)


def _export_layer(path: Path) -> LayerWidths:
    """The median layer (by its cached row) of an export, read as a runtime reads it."""
    from transformers import AutoConfig

    if not (path / MANIFEST).is_file():
        raise KVFoldError(f"--export {path} is not a kvfold export (no {MANIFEST}); pass an export's folder")
    config = AutoConfig.from_pretrained(path)
    try:
        dims = model_dims(config)
    except ValueError as e:
        raise KVFoldError(f"--export {path}: {e}") from None
    i = sorted(range(len(dims)), key=lambda n: sum(dims[n].row_bytes()))[len(dims) // 2]
    return LayerWidths(f"{path.name} export layer {i}", head_dim(config), dims[i])


def _timer(device: torch.device):
    """Median seconds of fn() after warm-up: CUDA events on a GPU, wall clock elsewhere."""
    def run(fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _time_sdpa(rand, b: int, h: int, g: int, t: int, s: int, d: int, timed, reps: int,
               graph: bool = False) -> tuple[float, float | None]:
    """Uncompressed: q [B, H, T, d], k/v [B, G, S, d] with GQA, the path transformers' sdpa runs (its tensors
    are freed on return, before the compressed ones are made); and with `graph` its time replayed from a CUDA graph
    (else None)."""
    q, k, v = rand(b, h, t, d), rand(b, g, s, d), rand(b, g, s, d)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
    return timed(sdpa, reps), timed(graphed(sdpa), reps) if graph else None


def _time_into(row: dict, name: str, fn, t_sdpa: float, timed, reps: int) -> float:
    """Time `fn` and write its microseconds and its ratio to SDPA's time into `row` as NAME_us / NAME_ratio."""
    t = timed(fn, reps)
    row[f"{name}_us"], row[f"{name}_ratio"] = round(t * 1e6, 1), round(t / t_sdpa, 3)
    return t


def _decode_row(layer: LayerWidths, b: int, s: int, dtype, device, timed, reps: int, graphs: bool = False) -> dict:
    import kvfold_runtime as rt

    g, d, h = len(layer.d_k), layer.head_dim, layer.num_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    scaling = d ** -0.5
    graphs = graphs and layer.dims.banded and aligned(layer.dims)  # the page layout's steps, as vLLM would capture
    t_sdpa, t_sdpa_graph = _time_sdpa(rand, b, h, g, 1, s, d, timed, reps, graph=graphs)
    row = {"kind": "decode", "layer": layer.name, "p": round(layer.p, 4), "batch": b, "context": s,
           "sdpa_us": round(t_sdpa * 1e6, 1), "ideal_ratio": round(1 - layer.p, 4)}
    if graphs:
        row["sdpa_graph_us"] = round(t_sdpa_graph * 1e6, 1)
    q = rand(b, 1, layer.group * sum(layer.d_k))
    if layer.dims.banded:
        k_rows, v_rows = _bits_rows(layer, b, s, device, gen)
        t = _time_into(row, "kvfold_triton_bits",
                       lambda: rt.bits_attention(q, k_rows, v_rows, layer.dims, scaling=scaling), t_sdpa, timed, reps)
        row["kvfold_triton_bits_tb_per_s"] = round(b * s * sum(layer.dims.row_bytes()) / t / 1e12, 3)
        if aligned(layer.dims):  # what vLLM runs on CUDA for such a layer: its cache in the GPU page layout
            from kvfold_runtime.kernels.triton_pages import paged_pages_attention

            del k_rows, v_rows
            kv, table, lens, starts = _pages(layer, b, s, device, gen)
            t = _time_into(row, "kvfold_triton_pages",
                           lambda: paged_pages_attention(q[:, 0], kv, table, lens, starts, layer.dims,
                                                         scaling=scaling, max_query_len=1, max_seq_len=s),
                           t_sdpa, timed, reps)
            row["kvfold_triton_pages_tb_per_s"] = round(b * s * sum(layer.dims.row_bytes()) / t / 1e12, 3)
            _time_into(row, "kvfold_triton_pages_window", windowed_step(layer, q[:, 0], kv, table, lens, starts,
                                                                          s, scaling, gen), t_sdpa, timed, reps)
            _time_into(row, "kvfold_triton_pages_step", paged_step(layer, q[:, 0], kv, table, lens, starts, s,
                                                                    scaling, gen), t_sdpa, timed, reps)
            if graphs:  # each step replayed from a CUDA graph, against SDPA's replay: launches and host work gone
                for name, make in (("window", windowed_step), ("step", paged_step)):
                    try:
                        replay = graphed(make(layer, q[:, 0], kv, table, lens, starts, s, scaling, gen))
                    except RuntimeError as e:  # a step that cannot be captured: why, in the row
                        row[f"kvfold_triton_pages_{name}_graph_error"] = str(e).splitlines()[0][:300]
                        continue
                    _time_into(row, f"kvfold_triton_pages_{name}_graph", replay, t_sdpa_graph, timed, reps)
        row["sdpa_tb_per_s"] = round(b * s * 2 * g * d * q.element_size() / t_sdpa / 1e12, 3)
        return row
    k, v = rand(b, s, sum(layer.d_k)), rand(b, s, sum(layer.d_v))
    args = (q, k, v, layer.d_k, layer.d_v, layer.group)
    for name, fn in (("kvfold_triton", lambda: rt.decode_attention(*args, scaling=scaling)),
                     ("kvfold_triton_balanced", lambda: rt.decode_attention(*args, scaling=scaling, balanced=True)),
                     ("kvfold_torch", lambda: rt.sdpa_attention(*args, scaling=scaling))):
        _time_into(row, name, fn, t_sdpa, timed, reps)
    kv_bytes = b * s * sum(layer.dims.row_bytes(q.element_size()))
    row["kvfold_triton_tb_per_s"] = round(kv_bytes / (row["kvfold_triton_us"] * 1e-6) / 1e12, 3)
    row["sdpa_tb_per_s"] = round(b * s * 2 * g * d * q.element_size() / t_sdpa / 1e12, 3)
    return row


def _prefill_row(layer: LayerWidths, t: int, dtype, device, timed, reps: int) -> dict:
    import kvfold_runtime as rt

    g, d, h = len(layer.d_k), layer.head_dim, layer.num_heads
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    scaling = d ** -0.5
    t_sdpa, _ = _time_sdpa(rand, 1, h, g, t, t, d, timed, reps)
    row = {"kind": "prefill", "layer": layer.name, "p": round(layer.p, 4), "tokens": t,
           "sdpa_us": round(t_sdpa * 1e6, 1), "flop_ratio": round(layer.flop_ratio, 4)}
    q = rand(1, t, layer.group * sum(layer.d_k))
    if layer.dims.banded:
        k_rows, v_rows = _bits_rows(layer, 1, t, device, gen)
        _time_into(row, "kvfold_triton_bits",
                   lambda: rt.bits_attention(q, k_rows, v_rows, layer.dims, scaling=scaling), t_sdpa, timed, reps)
        return row
    k, v = rand(1, t, sum(layer.d_k)), rand(1, t, sum(layer.d_v))
    args = (q, k, v, layer.d_k, layer.d_v, layer.group)
    for name, fn in (("kvfold_triton", lambda: rt.prefill_attention(*args, scaling=scaling)),
                     ("kvfold_torch", lambda: rt.sdpa_attention(*args, scaling=scaling))):
        _time_into(row, name, fn, t_sdpa, timed, reps)
    return row


def bench_kernels(export: Path | None, dtype: str, smoke: bool, reps: int, graphs: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if graphs and device.type != "cuda":
        raise KVFoldError("--graphs replays the decode steps from CUDA graphs: run it on a GPU (or leave it out)")
    if device.type != "cuda" and not smoke:
        raise KVFoldError("kvfold-bench kernels times GPU kernels and this machine has no CUDA device; run it on "
                          "a GPU (or pass --smoke for a tiny functional run)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KVFoldError("--smoke without a GPU runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise KVFoldError(f"--dtype {dtype}: use bfloat16, float16 or float32")
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=32) if smoke else LLAMA3_8B
    layers = [synthetic_layer(p, uneven, **shape) for p in (0.25, 0.5) for uneven in (False, True)]
    layers += _bits_layers(**shape)
    if export is not None:
        layers.insert(0, _export_layer(Path(export)))
    timed = _timer(device)
    t0 = time.perf_counter()
    rows = []
    for layer in layers:
        for b, s in (SMOKE_DECODE if smoke else DECODE):
            rows.append(_decode_row(layer, b, s, torch_dtype, device, timed, reps, graphs))
        for t in (SMOKE_PREFILL if smoke else PREFILL):
            rows.append(_prefill_row(layer, t, torch_dtype, device, timed, reps))
    return {
        "benchmark": "kernels", "date": datetime.date.today().isoformat(), "kvfold_version": kvfold.__version__,
        "torch_version": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else
        f"{platform.machine()} CPU (Triton interpreter: timings meaningless)", "dtype": dtype, "smoke": smoke,
        "layers": [{"name": w.name, "num_heads": w.num_heads, "head_dim": w.head_dim, "d_k": w.d_k, "d_v": w.d_v,
                    "p": round(w.p, 4), "bytes_per_token": sum(w.dims.row_bytes(torch_dtype.itemsize))}
                   for w in layers],
        "rows": rows, "seconds": round(time.perf_counter() - t0, 1),
        "notes": ["ratio = time / uncompressed SDPA's time on the same shape in this run; decode's ideal is 1 − p "
                  "(bytes read), prefill's the FLOP ratio Σ_h (d_k + d_v) / 2·H·d (a bits layer's FLOPs are SDPA's: "
                  "it dequantizes every kept dim)",
                  "bits layers: p against 16-bit numbers; kvfold_triton_bits reads the band codes as rows, "
                  "kvfold_triton_pages (decode) in the GPU page layout vLLM keeps an aligned bits layer in (pages of "
                  f"{PAGE} tokens); kvfold_triton_pages_window: the same cache as a windowed layer's (16 sinks and a "
                  "64-token window whole in a ring, the rest from the pages), its whole step as vLLM's backend runs "
                  "it (the new token's codes and ring row written, the attention); "
                  "kvfold_triton_pages_step: a plain layer's whole step as the backend runs it (the new token encoded "
                  "into its page slot, then the attention: host work and every launch)",
                  "--graphs: *_graph: the same steps replayed from a CUDA graph (vLLM's full CUDA-graph mode, not "
                  "declared by kvfold's backend yet), their ratio against SDPA's replay (sdpa_graph_us)"],
    }


def draw(report: dict, path: Path) -> None:
    """Time ratio vs p per method (decode at the longest context, prefill at the longest prompt), with the
    1 − p line."""
    from kvfold_bench.frontier.plot import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, kind in zip(axes, ("decode", "prefill"), strict=True):
        rows = [r for r in report["rows"] if r["kind"] == kind]
        longest = max(r["context" if kind == "decode" else "tokens"] for r in rows)
        for method, marker in (("kvfold_triton", "o"), ("kvfold_triton_balanced", "^"), ("kvfold_torch", "s"),
                               ("kvfold_triton_bits", "D"), ("kvfold_triton_pages", "P"),
                               ("kvfold_triton_pages_window", "X"), ("kvfold_triton_pages_step", "*")):
            pts = [(r["p"], r[f"{method}_ratio"], r) for r in rows if f"{method}_ratio" in r
                   and r["context" if kind == "decode" else "tokens"] == longest]
            if pts:
                ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], marker=marker, label=method, alpha=0.7)
        xs = [0.0, 0.6]
        ax.plot(xs, [1 - x for x in xs], "k:", label="1 − p")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("compression p of the layer")
        ax.set_ylabel("time / uncompressed SDPA")
        ax.set_title(f"{kind}, {'context' if kind == 'decode' else 'prompt'} {longest} ({report['dtype']})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvfold-bench kernels, {report['date']}, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
