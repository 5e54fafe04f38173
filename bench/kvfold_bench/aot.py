"""`kvfold-bench kernels --aot sm_90`: where a decode's time goes, read from the kernels compiled ahead of time for
an H100 / H200 (sm_90) on a machine without a GPU (issue 50's instrument).

Each kernel is launched by its own launcher (kvfold_runtime's bits_attention / paged_bits_attention /
decode_attention / paged_decode_attention / prefill_attention, vLLM 0.32's TritonAttentionImpl.forward for
`int4_per_token_head`) on small CPU tensors of the real strides and dtypes, with every Triton launch recorded
instead of run; each recorded launch is then specialised exactly as Triton's JIT would specialise it (its binder:
constexprs, ints equal to 1, 16-byte divisibility) and compiled with `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))` and its num_warps / num_stages. The cubin is read with nvdisasm and cuobjdump
(kvfold_bench.sass). The launchers pick splits for a 132-SM device (H100 SXM, H200), as they would there.

The unit: thread-instructions per cached number = SASS instructions in the main loop's body × num_warps × 32 ÷
the cached numbers one pass of the body consumes (tokens per tile × (d_k + d_v) of the one KV head a program
reads; for a prefill program, of the tile it reads for its queries). A call's total adds every instruction outside
the loop once per program and every kernel the call launches (the split-K merge kernel too), over the call's
cached numbers (batch × context × KV heads × (d_k + d_v)): a static count, not a profile.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfold_bench import sass

if TYPE_CHECKING:
    from kvfold_bench.aot_cases import Case

__all__ = ["UNIT", "Launch", "aot_report", "capture", "compile_launch", "kernel_figures", "run_case"]

UNIT = __doc__.split("\n\n")[2].replace("\n", " ").strip()  # the module docstring's paragraph "The unit: ..."


@dataclass
class Launch:
    kernel: object  # a triton JITFunction
    args: tuple
    kwargs: dict
    grid: tuple


@contextlib.contextmanager
def capture(*kernels):
    """Record the launches of `kernels` (JITFunctions) instead of running them: yields the list they go into."""
    from triton.runtime.jit import JITFunction

    from kvfold.errors import KVFoldError

    for k in kernels:
        if not isinstance(k, JITFunction):
            raise KVFoldError(f"{k} is not a compiled Triton kernel (TRITON_INTERPRET=1 is set?): the ahead-of-time "
                              "count needs Triton's compiler; unset TRITON_INTERPRET")
    launches: list[Launch] = []

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            launches.append(Launch(kernel, args, kwargs, tuple(int(g) for g in grid)))
        return run

    for k in kernels:
        k.run = recorder(k)  # an instance attribute over JITFunction.run; fn[grid](...) calls self.run
    try:
        yield launches
    finally:
        for k in kernels:
            vars(k).pop("run", None)


def compile_launch(launch: Launch, arch: int = 90, facts: bool = True):
    """(compiled kernel, constexprs by name) of a recorded launch, for CUDA sm_`arch`, as Triton's JIT run would
    compile it on such a device. facts=False drops the arguments' alignment facts (16-byte divisibility) the JIT
    passes as attrs: `triton.compile(ASTSource(fn, signature, constexprs))` as written by hand."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    fn, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug  # as JITFunction.run
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run, where the release has it
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs if facts else {}), target=target,
                              options=options.__dict__)
    names = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    return compiled, names


def kernel_figures(launch: Launch, facts: bool = True) -> dict:
    """One launch's compiled figures (module docstring)."""
    compiled, constexprs = compile_launch(launch, facts=facts)
    meta = compiled.metadata
    text, usage = sass.disassemble(compiled.asm["cubin"])
    code = sass.Sass.parse(text)
    warps, shared = meta.num_warps, meta.shared + usage.get("SHARED", 0)
    loop = code.main_loop()
    out = {
        "kernel": launch.kernel.__name__, "source": f"{launch.kernel.fn.__module__}",
        "num_warps": warps, "num_stages": meta.num_stages, "grid": list(launch.grid),
        "constexprs": {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in constexprs.items()},
        "registers": usage.get("REG"), "spills": {"ldl_stl_instructions": code.local_memory,
                                                   "stack_bytes": usage.get("STACK", 0),
                                                   "local_bytes": usage.get("LOCAL", 0)},
        "shared_bytes": shared, "programs_per_sm": sass.programs_per_sm(usage.get("REG", 0), shared, warps),
        "instructions": len(code.instructions), "loops": [loop_.instructions for loop_ in code.loops()],
        "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:16],
    }
    if loop is not None:
        out["main_loop"] = {"instructions": loop.instructions, "nops": loop.nops, "global_loads": loop.loads,
                            "widest_load_bytes": loop.widest_load, "narrowest_load_bytes": loop.narrowest_load,
                            "ldl_stl_instructions": loop.local_memory, "shared_memory": loop.shared,
                            "shared_bytes_per_thread": loop.shared_bytes}
    return out


def _per_number(figures: dict, case: Case, d: int) -> float:
    """The main loop's thread-instructions per cached number (its tile: tokens × (d_k + d_v) = tokens × 2d)."""
    loop = figures["main_loop"]
    loop["tokens_per_pass"] = figures["constexprs"][case.tokens]
    loop["numbers_per_pass"] = loop["tokens_per_pass"] * 2 * d
    loop["thread_instructions_per_number"] = round(loop["instructions"] * figures["num_warps"] * 32
                                                   / loop["numbers_per_pass"], 2)
    # the L1's other load: at 4 bits a number is 0.5 bytes of DRAM; a tile staged through shared memory adds its
    # bytes twice (stored, then loaded for the tensor cores), on the unit that also serves the global loads
    loop["shared_bytes_per_number"] = round(loop["shared_bytes_per_thread"] * figures["num_warps"] * 32
                                            / loop["numbers_per_pass"], 2)
    return loop["thread_instructions_per_number"]


def run_case(case: Case, d: int, without_facts: bool = False) -> dict:
    """A case's kernels' figures at head_dim d, and (decode) the whole call's thread-instructions per number.
    without_facts: also the main kernel compiled without the alignment facts (compile_launch), as a hand count."""
    from kvfold_bench.aot_cases import DTYPE, HEADS, KV_HEADS

    launches = case.make(d)
    figures = [kernel_figures(launch) for launch in launches]
    out = {"case": case.name, "head_dim": d, "heads": HEADS, "kv_heads": KV_HEADS, "dtype": str(DTYPE),
           "thread_instructions_per_number": _per_number(figures[0], case, d),
           "registers": figures[0]["registers"], "kernels": figures}
    tokens = figures[0]["main_loop"]["tokens_per_pass"]
    if without_facts:
        bare = kernel_figures(launches[0], facts=False)
        out["without_alignment_facts"] = {"thread_instructions_per_number": _per_number(bare, case, d),
                                          "main_loop_instructions": bare["main_loop"]["instructions"],
                                          "registers": bare["registers"]}
    if case.batch is not None:
        out["call"] = call_figures(figures, case.batch, tokens, KV_HEADS * 2 * d)
    return out


def call_figures(figures: list[dict], batch: int, tokens: int, numbers_per_token: int) -> dict:
    """A decode call of `batch` sequences × aot_cases.CONTEXT tokens, its kernels' `figures` (the main one first,
    whose loop reads `tokens` a pass of one KV head): thread-instructions per cached number over every kernel, each
    instruction outside the main loop counted once per program, the loop's once per pass."""
    from kvfold_bench.aot_cases import CONTEXT, KV_HEADS

    numbers = batch * CONTEXT * numbers_per_token
    passes = batch * KV_HEADS * math.ceil(CONTEXT / tokens)
    total = 0
    for f in figures:
        programs = math.prod(f["grid"])
        body = f["main_loop"]["instructions"] if f is figures[0] else 0
        total += f["num_warps"] * 32 * (programs * (f["instructions"] - body) + passes * body)
    return {"batch": batch, "context": CONTEXT, "cached_numbers": numbers, "kernels": [f["kernel"] for f in figures],
            "thread_instructions_per_number": round(total / numbers, 2)}


def aot_report(arch: str = "sm_90", head_dims: tuple[int, ...] = (128, 64), cases: list[Case] | None = None) -> dict:
    """`kvfold-bench kernels --aot sm_90`: every case (kvfold_bench.aot_cases) at each head_dim."""
    import triton

    from kvfold.errors import KVFoldError
    from kvfold_bench import aot_cases as c

    if arch != "sm_90":
        raise KVFoldError(f"--aot {arch}: only sm_90 (H100 / H200) is modelled; pass --aot sm_90")
    sass.tools()  # a clear error now rather than after the first compile
    rows = [run_case(case, d, without_facts=case.hand_count) for d in head_dims for case in (cases or c.CASES)]
    mixed = {d: kernel_figures(c.bits_decode(d, paged=False, mixed=True)[0])["cubin_sha256"] for d in head_dims}
    return {
        "benchmark": "kernels --aot", "date": datetime.date.today().isoformat(), "arch": arch,
        "triton_version": triton.__version__,
        "shapes": {"heads": c.HEADS, "kv_heads": c.KV_HEADS, "decode_batch_context": [c.DECODE_BATCH, c.CONTEXT],
                   "prefill_tokens": c.PREFILL_TOKENS, "block_size": c.BLOCK, "sms": c.SMS, "dtype": str(c.DTYPE)},
        "rows": rows,
        "bits_mixed_widths_cubin": mixed,
        "notes": [UNIT,
                  "main loop: the backward branch (BRA to an earlier label) spanning the most instructions; every "
                  "instruction between its label and the branch counts once (kvfold_bench.sass)",
                  "the bits kernel's band widths are table data read at run time, not constexprs: an 8/5/4 | 6/4-bit "
                  "layer compiles to the same cubin as 4 bits everywhere (bits_mixed_widths_cubin vs the 4-bit "
                  "row's cubin_sha256)",
                  "without_alignment_facts: the same kernel compiled from ASTSource(fn, signature, constexprs) "
                  "with no attrs (no 16-byte divisibility facts), as issue 50's hand count did (1,792 instructions, "
                  "227 registers for the contiguous bits decode at head_dim 128); a real launch passes them",
                  "rank rows keep every dim (d_k = d_v = head_dim), the tile of an uncompressed bfloat16 cache",
                  "call: static count over one decode call of batch × context, every kernel it launches"],
    }


def export_report(path, arch: str = "sm_90") -> dict:
    """`kvfold-bench kernels --aot sm_90 --export PATH`: the page-layout decode compiled for every kind of KV head
    an export's aligned bits layers have (kvfold_runtime.pages.PageLayout.kinds: each chunk's width), at the
    export's shape (its heads, a decode call of aot_cases' batch and context). Per kind: the main loop's
    thread-instructions per cached number of that kind's heads (tokens × (d_k + d_v)), registers, spills, the
    narrowest load; and how many (layer, KV head) pairs have it."""
    from pathlib import Path

    import torch
    from transformers import AutoConfig

    from kvfold.errors import KVFoldError
    from kvfold_bench import aot_cases as c
    from kvfold_runtime import MANIFEST, LayerDims, model_dims
    from kvfold_runtime.kernels import triton_decode, triton_pages
    from kvfold_runtime.pages import aligned, page_layout

    path = Path(path)
    if arch != "sm_90":
        raise KVFoldError(f"--aot {arch}: only sm_90 (H100 / H200) is modelled; pass --aot sm_90")
    if not (path / MANIFEST).is_file():
        raise KVFoldError(f"--export {path} is not a kvfold export (no {MANIFEST}); pass an export's folder")
    layers = model_dims(AutoConfig.from_pretrained(path))
    if not all(aligned(d) for d in layers):
        raise KVFoldError(f"--export {path}: its bits bands are not all on 8- or 16-dim chunks, so vLLM serves it "
                          "with the row kernels; re-export without --band-align (aligned by default) to count the page "
                          "layout's")
    sass.tools()
    kinds: dict[tuple, dict] = {}
    for n, dims in enumerate(layers):
        found, of_head = page_layout(dims, c.BLOCK).kinds()
        for g, k in enumerate(of_head):
            entry = kinds.setdefault(found[k], {"heads": [], "dims": (dims, g)})
            entry["heads"].append([n, g])
    rows = []
    for kind, entry in kinds.items():
        dims, g = entry["dims"]
        one = LayerDims((dims.d_k[g],) * dims.num_kv_heads, (dims.d_v[g],) * dims.num_kv_heads, dims.group,
                        (dims.k_bands[g],) * dims.num_kv_heads, (dims.v_bands[g],) * dims.num_kv_heads)
        layout, b = page_layout(one, c.BLOCK), c.DECODE_BATCH
        with capture(triton_pages._pages_kernel, triton_decode._combine_kernel) as launches:
            q = torch.zeros(b, one.q_width, dtype=c.DTYPE)
            kv = torch.zeros(8, 1, c.BLOCK, layout.row_bytes, dtype=torch.uint8)
            triton_pages.paged_pages_attention(
                q, kv, torch.zeros(b, c.CONTEXT // c.BLOCK, dtype=torch.int32),
                torch.full((b,), c.CONTEXT, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32), one,
                scaling=1.0, max_query_len=1, max_seq_len=c.CONTEXT, num_splits=c._splits(b, c.CONTEXT))
        figures = [kernel_figures(launch) for launch in launches]
        f, loop = figures[0], figures[0]["main_loop"]
        numbers = f["constexprs"]["BLOCK_N"] * (one.d_k[0] + one.d_v[0])
        call = call_figures(figures, b, f["constexprs"]["BLOCK_N"], c.KV_HEADS * (one.d_k[0] + one.d_v[0]))
        rows.append({"key_widths": list(kind[0]), "value_widths": list(kind[3]), "d_k": one.d_k[0],
                     "d_v": one.d_v[0], "heads": len(entry["heads"]), "layer_heads": entry["heads"],
                     "thread_instructions_per_number": round(loop["instructions"] * f["num_warps"] * 32 / numbers, 2),
                     "call_thread_instructions_per_number": call["thread_instructions_per_number"],
                     "main_loop_instructions": loop["instructions"], "registers": f["registers"],
                     "spills": f["spills"], "main_loop_ldl_stl_instructions": loop["ldl_stl_instructions"],
                     "narrowest_load_bytes": loop["narrowest_load_bytes"]})
    total = sum(r["heads"] for r in rows)
    return {"benchmark": "kernels --aot --export", "date": datetime.date.today().isoformat(), "arch": arch,
            "export": str(path), "kinds": rows, "kv_heads": total,
            "max_thread_instructions_per_number": max(r["thread_instructions_per_number"] for r in rows),
            "mean_thread_instructions_per_number": round(
                sum(r["thread_instructions_per_number"] * r["heads"] for r in rows) / total, 2),
            "max_call_thread_instructions_per_number": max(r["call_thread_instructions_per_number"] for r in rows),
            "notes": [UNIT, "per kind: one layer of that kind's heads, decode of "
                      f"{c.DECODE_BATCH} sequences × {c.CONTEXT} tokens in {c.BLOCK}-token pages; numbers are the "
                      "kind's kept dims (d_k + d_v) per token; the mean weighs kinds by their (layer, KV head) pairs",
                      "call: the whole decode call, split merge included (run_case's call), per kind"]}
