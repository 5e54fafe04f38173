"""Issue 50's instrument (kvfold_bench.aot): kernels compiled ahead of time for sm_90 on this CPU machine, their
main loop's SASS counted. The counter must reproduce the figures read by hand from the row-layout kernel (the bits
decode ≈ 56 thread-instructions per cached number, vLLM 0.32's int4_per_token_head decode ≈ 23 at 16 sequences),
and the bits decode over the GPU page layout is held to its budget: ≤ 8 per number, whole call included.
Skips only where the Triton install lacks ptxas / nvdisasm / cuobjdump (its NVIDIA wheel ships them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfold.errors import KVFoldError
from kvfold.sources.embedded import cache_root
from kvfold_bench import aot, aot_cases, sass


@pytest.fixture(scope="module", autouse=True)
def _tools():
    try:
        sass.tools()
    except KVFoldError as e:
        pytest.skip(str(e))


def _case(name: str) -> aot_cases.Case:
    return next(c for c in aot_cases.CASES if c.name == name)


@pytest.fixture(scope="module")
def bits_decode() -> dict:
    """The row-layout contiguous bits decode at Llama-3-8B's shape (head_dim 128), compiled once for the module."""
    return aot.run_case(_case("kvfold bits decode (contiguous)"), 128)


PAGES = "kvfold bits decode, GPU page layout, {} (paged)"
MIX = "8/5/4 | 6/4 bits"


@pytest.fixture(scope="module", params=[("4 bits", 128), ("4 bits", 64), (MIX, 128), (MIX, 64),
                                        (MIX + " on 8-dim chunks", 64), ("6/4 | 3/2/0 bits", 128),
                                        ("6/4 | 3/2/0 bits", 64)], ids=lambda p: f"{p[0]}@{p[1]}")
def pages_decode(request) -> dict:
    """The page-layout bits decode: 4 bits everywhere, an export-like mix, and a windowed export's history (2- and
    3-bit values, staged through shared memory, cost ~12 a number at head_dim 128; a quarter of the dims unheld: its
    chunks are zeros), at head_dim 128 and 64 (8-dim chunks: head_dim 64's alignment, formats/bits.band_align_for)."""
    widths, d = request.param
    return aot.run_case(_case(PAGES.format(widths)), d)


@pytest.fixture(scope="module")
def vllm_int4_decode() -> dict:
    pytest.importorskip("vllm")
    case = next(c for c in aot_cases.CASES if c.name.startswith("vLLM") and c.batch == 16)
    return aot.run_case(case, 128)


def test_sass_parsing():
    text = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R4.64] ;
        /*0030*/                   NOP ;
        /*0038*/                   LDGDEPBAR ;
        /*003a*/                   STS.128 [R3], R8 ;
        /*003b*/                   LDSM.16.MT88.4 R12, [R3] ;
        /*003c*/                   LDS.U16 R2, [R3+0x2] ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
.L_x_2:
        /*0060*/                   BRA `(.L_x_2);
"""
    loop = sass.Sass.parse(text).main_loop()
    assert (loop.instructions, loop.nops, loop.widest_load, loop.narrowest_load) == (8, 1, 16, 1)
    assert [lp.instructions for lp in sass.Sass.parse(text).loops()] == [8]  # the trap after EXIT is no loop
    # shared memory a thread moves: 16 stored, four 8×8 matrices of 16-bit numbers loaded (16), 2 (LDGDEPBAR: none)
    assert loop.shared == {"LDS.U16": 1, "LDSM.16.MT88.4": 1, "STS.128": 1} and loop.shared_bytes == 34
    # 235 registers × 8 warps: one program per SM; 116 × 4 warps: four
    assert sass.programs_per_sm(235, 14336, 8)["programs"] == 1
    assert sass.programs_per_sm(116, 10560, 4) == {"programs": 4, "warps": 16, "bound": "registers"}


def test_bits_decode_reproduces_the_hand_count(bits_decode):
    """Issue 50: 1,792 × 8 × 32 ÷ (32 tokens × 256) ≈ 56 at 227–255 registers, one 8-warp program per SM, byte
    loads (the hand count compiled without the JIT's alignment facts: 1,792 and 227; as the JIT compiles: 1,787 and
    235)."""
    main = bits_decode["kernels"][0]
    assert main["kernel"] == "_bits_kernel" and main["num_warps"] == 8
    assert main["main_loop"]["tokens_per_pass"] == 32 and main["main_loop"]["numbers_per_pass"] == 32 * 256
    assert 51 <= bits_decode["thread_instructions_per_number"] <= 61
    assert 227 <= bits_decode["registers"] <= 255
    assert main["programs_per_sm"]["programs"] == 1
    assert main["main_loop"]["narrowest_load_bytes"] == 1
    assert [k["kernel"] for k in bits_decode["kernels"]] == ["_bits_kernel", "_combine_kernel"]  # 5 splits at B=16
    assert bits_decode["call"]["thread_instructions_per_number"] >= bits_decode["thread_instructions_per_number"]


def test_vllm_int4_decode_reproduces_the_hand_count(vllm_int4_decode):
    """vLLM 0.32's packed int4 decode, 3D (split) kernel at 16 sequences: 4 warps, 16-token tiles, ≈ 23 per number
    with far fewer registers than the bits decode."""
    main = vllm_int4_decode["kernels"][0]
    assert main["kernel"] == "_attn_packed" and main["num_warps"] == 4
    assert main["constexprs"]["TILE_SIZE"] == 16 and main["constexprs"]["IS_3D"] is True
    assert 18 <= vllm_int4_decode["thread_instructions_per_number"] <= 25
    assert vllm_int4_decode["registers"] <= 160
    assert [k["kernel"] for k in vllm_int4_decode["kernels"]] == ["_attn_packed", "reduce_segments"]


def test_bits_decode_budget(pages_decode):
    """Issue 50's target for the bits decode: ≤ 8 thread-instructions per cached number in the main loop and over
    the whole call (the split merge and every instruction outside the loop counted), ≤ 128 registers, no spills,
    every global load in the main loop ≥ 4 bytes per thread."""
    main = pages_decode["kernels"][0]
    assert main["kernel"] == "_pages_kernel"
    assert pages_decode["thread_instructions_per_number"] <= 8
    assert pages_decode["call"]["thread_instructions_per_number"] <= 8
    if pages_decode["case"] == PAGES.format("4 bits"):
        # and what the paired unpacking (two numbers a register, triton_unpack), page segments, two warpgroup
        # products and (head_dim 128) the tiles made in the MMA's registers (triton_tiles) reached, with 15% to
        # spare: 4.16 at head_dim 128 (3.74 with both tiles staged through shared memory), 4.25 at 64; a change that
        # loses one of them (say, Triton re-packing pairs again) fails here before the budget does
        assert pages_decode["thread_instructions_per_number"] <= 1.15 * {128: 4.16, 64: 4.25}[pages_decode["head_dim"]]
        # shared memory: the tiles stored and loaded again for the tensor cores, 2.31 bytes a number at head_dim 128
        # (the values' only; 4.31 with the keys' too) and 4.38 at 64, against the codes' 0.5 from DRAM, on the L1
        # that also serves the global loads: an H200's profile of this kernel (2026-12-04) found the L1 its busiest
        # unit (89%, DRAM 14%). Held so that it can only fall
        shared = pages_decode["kernels"][0]["main_loop"]["shared_bytes_per_number"]
        assert shared <= 1.05 * {128: 2.31, 64: 4.38}[pages_decode["head_dim"]]
    assert pages_decode["registers"] <= 128
    assert main["spills"] == {"ldl_stl_instructions": 0, "stack_bytes": 0, "local_bytes": 0}
    assert main["main_loop"]["narrowest_load_bytes"] >= 4


def test_8_dim_chunks_cost_about_what_16_dim_ones_do_at_head_dim_64():
    """The mixed layer (8/5/4 | 6/4 bits) at head_dim 64 on 8-dim chunks, the bits format's alignment there
    (formats/bits.band_align_for): within 5% of the same widths on 16-dim chunks per cached number (measured 6.47
    against 6.50), within 128 registers and without spills (at head_dim 128 8-dim chunks cost 6.1, 19.5 before the
    tiles were made in the MMA's registers: the alignment there stays 16)."""
    sixteen, eight = (aot.run_case(_case(PAGES.format(MIX + on)), 64) for on in ("", " on 8-dim chunks"))
    assert eight["kernels"][0]["constexprs"]["CH"] == 8 and sixteen["kernels"][0]["constexprs"]["CH"] == 16
    assert eight["thread_instructions_per_number"] <= 1.05 * sixteen["thread_instructions_per_number"]
    assert eight["registers"] <= 128 and eight["kernels"][0]["spills"]["ldl_stl_instructions"] == 0


def test_cli_takes_only_sm_90():
    from typer.testing import CliRunner

    from kvfold_bench.cli import app
    from tests.test_cli import assert_user_error

    assert_user_error(CliRunner().invoke(app, ["kernels", "--aot", "sm_80"]), "only sm_90")


def test_an_exports_kinds_of_head_are_compiled(tiny_dirs, tmp_path):
    """--aot sm_90 --export: a tiny bits export (bands aligned, the default) compiled per kind of head, every
    (layer, KV head) counted once; an export with bands anywhere is refused in one line."""
    from typer.testing import CliRunner

    from kvfold_bench.cli import app
    from tests.conftest import write_tiny_text
    from tests.runtime.conftest import write_export
    from tests.test_cli import assert_user_error, run

    text = write_tiny_text(tmp_path / "eval.txt")
    model = tiny_dirs["LlamaForCausalLM"]
    assert run("calibrate", model, "-o", tmp_path / "calib", "--tokens", 512, "--seq-len", 64).exit_code == 0
    done = run("export", model, "--calib", tmp_path / "calib", "--eval-text", text, "--eval-tokens", 256,
               "--margin", 0, "--accuracy", 0.5, "--format", "bits", "--passkey", 0, "-o", tmp_path / "aligned")
    assert done.exit_code == 0, done.output
    out = tmp_path / "aot.json"
    done = CliRunner().invoke(app, ["kernels", "--aot", "sm_90", "--export", str(tmp_path / "aligned"), "--json",
                                    str(out)])
    assert done.exit_code == 0, done.output
    report = json.loads(out.read_text())
    pairs = [tuple(p) for kind in report["kinds"] for p in kind["layer_heads"]]
    assert len(pairs) == len(set(pairs)) == report["kv_heads"] == 2 * 2  # the tiny Llama: 2 layers × 2 KV heads
    assert all(k["thread_instructions_per_number"] > 0 and k["registers"] <= 128 for k in report["kinds"])
    # spills are counted over the kernel and, apart, in the main loop, where they cost per cached number
    assert all(0 <= k["main_loop_ldl_stl_instructions"] <= k["spills"]["ldl_stl_instructions"]
               for k in report["kinds"])
    assert report["max_thread_instructions_per_number"] >= report["mean_thread_instructions_per_number"]
    # the whole call (split merge and everything outside the loop) costs more than the loop alone
    assert all(k["call_thread_instructions_per_number"] > k["thread_instructions_per_number"] for k in report["kinds"])
    assert report["max_call_thread_instructions_per_number"] == max(k["call_thread_instructions_per_number"]
                                                                      for k in report["kinds"])
    loose = write_export("LlamaForCausalLM", model, tmp_path / "loose", "uneven", bits="low")  # 4-dim bands
    assert_user_error(CliRunner().invoke(app, ["kernels", "--aot", "sm_90", "--export", str(loose.path)]),
                      "not all on 8- or 16-dim chunks")


@pytest.mark.parametrize("d", [128, 64])
def test_a_windowed_layers_codes_part_costs_what_the_plain_decode_does(d):
    """A windowed bits layer's decode on a GPU reads its codes by the same page kernel, hiding the sinks and the
    window (triton_pages.history_parts): issue 50's budget holds, and its main loop costs within 5% of the plain
    decode's with the same widths (measured 746 against 716 instructions at head_dim 128; 842 / 840 at 64)."""
    history = aot.run_case(_case(f"kvfold windowed bits decode's codes part, GPU page layout, {MIX} (paged)"), d)
    plain = aot.run_case(_case(PAGES.format(MIX)), d)
    main = history["kernels"][0]
    assert [k["kernel"] for k in history["kernels"]] == ["_pages_kernel"]  # parts left for the merge: no combine
    assert history["thread_instructions_per_number"] <= 8 and history["call"]["thread_instructions_per_number"] <= 8
    assert history["thread_instructions_per_number"] <= 1.05 * plain["thread_instructions_per_number"]
    assert history["registers"] <= 128
    assert main["spills"] == {"ldl_stl_instructions": 0, "stack_bytes": 0, "local_bytes": 0}
    assert main["main_loop"]["narrowest_load_bytes"] >= 4


@pytest.mark.parametrize("d", [128, 64])
def test_a_windowed_decode_with_keys_at_2_bits_stays_within_the_budget(d):
    """Qwen2.5-Coder's default export (keys 8/3/2, values 4/3/2 bits) decoded as a windowed layer on a GPU: the
    page kernel's codes part, then the sinks, the window and the merge in one launch (triton_ring). Both compile
    for sm_90 without spills, and the whole call stays within issue 50's budget of 8 instructions a cached number
    at 32K tokens at head_dim 128 (measured 6.27, its main loop 5.99); at 64, where the merge's share of a number
    doubles, 8.5 (measured 8.21, its main loop 7.66)."""
    case = _case("kvfold windowed bits decode, GPU page layout, 8/3/2 | 4/3/2 bits (paged): codes part, ring merge")
    row = aot.run_case(case, d)
    assert [k["kernel"] for k in row["kernels"]] == ["_pages_kernel", "_ring_merge_kernel"]
    for kernel in row["kernels"]:
        assert kernel["registers"] <= 128, kernel
        assert kernel["spills"] == {"ldl_stl_instructions": 0, "stack_bytes": 0, "local_bytes": 0}, kernel
    assert row["thread_instructions_per_number"] <= 8
    assert row["call"]["thread_instructions_per_number"] <= (8 if d == 128 else 8.5)


# The oldest Triton the runtime's kernels must compile with: torch 2.11's (runtime/pyproject.toml: torch>=2.11), which
# scripts/setup.sh installs in a folder of its own. A kernel written with a newer Triton's features (a tuple of
# tuples passed as a constexpr, a @triton.jit helper's result used as a compile-time condition) fails there only.
OLDEST_TRITON = "3.6.0"
OLDEST_TRITON_DIR = cache_root() / f"triton-{OLDEST_TRITON}"
_OLDEST_CHILD = """
import json, triton
from kvfold_bench.aot import run_case
from kvfold_bench.aot_cases import CASES
rows = [run_case(case, 128) for case in CASES if case.name.startswith("kvfold")]
from tests.bench.test_aot import write_path_figures
writes = write_path_figures()
print(json.dumps({"triton": triton.__version__, "file": triton.__file__, "writes": writes,
                  "rows": [[r["case"], r["head_dim"], r["thread_instructions_per_number"]] for r in rows]}))
"""


def write_path_figures() -> dict:
    """The GPU write path (kernels/triton_encode.py: the band-code writer, keys and values in one launch, the page
    scatter, the row copy) compiled for sm_90 at Llama-3-8B's shape (8 KV heads of 128 dims, keys in 8/5/4-bit
    bands, values in 6/4), pages of 16 tokens: each kernel's registers and spills (the writer's PTX `mul.rn` must
    pass ptxas too)."""
    import torch

    from kvfold_runtime.bands import bands_from_bits
    from kvfold_runtime.format import LayerDims
    from kvfold_runtime.kernels import triton_encode
    from kvfold_runtime.pages import page_layout

    keys = tuple(bands_from_bits([8] * 16 + [5] * 48 + [4] * 64) for _ in range(8))
    values = tuple(bands_from_bits([6] * 32 + [4] * 96) for _ in range(8))
    layout = page_layout(LayerDims((128,) * 8, (128,) * 8, 4, keys, values), 16)
    kernels = (triton_encode._encode_kernel, triton_encode._scatter_kernel, triton_encode._copy_kernel)
    with aot.capture(*kernels) as launches:
        triton_encode.write_pages(torch.zeros(2, 1, 16, layout.row_bytes, dtype=torch.uint8), torch.tensor([3, 20]),
                                  torch.zeros(2, 8 * 128), torch.zeros(2, 8 * 128), layout)
        # a rank layer's numbers: rows copied to their slots
        triton_encode.copy_rows(torch.zeros(2, 1, 16, 2048, dtype=torch.bfloat16), torch.tensor([3, 20]),
                                torch.zeros(2, 2048, dtype=torch.bfloat16))
    figures = [aot.kernel_figures(launch) for launch in launches]
    assert [f["kernel"] for f in figures] == ["_encode_kernel", "_scatter_kernel", "_copy_kernel"], figures
    worst = {}  # per kernel, its launch with the most registers
    for f in sorted(figures, key=lambda f: f["registers"]):
        worst[f["kernel"]] = {"registers": f["registers"], "spills": f["spills"]}
    return worst


def test_the_gpu_write_path_compiles_without_spills():
    """The writer runs a program a token and head: its tiles fit in registers (a first version, a program a token
    over all 8 heads, took 255 registers and spilled); the scatter a program a token and 512 page bytes."""
    for figures in write_path_figures().values():
        assert figures["registers"] <= 128 and figures["spills"]["ldl_stl_instructions"] == 0, figures


def test_every_kvfold_kernel_compiles_with_the_oldest_triton():
    """Every kvfold case (pages on 16- and 8-dim chunks, windowed, rows, rank; decode and prefill) and the GPU write
    path compiled for sm_90 at head_dim 128 by Triton 3.6 in a child process: what a GPU with torch 2.11 runs (the
    page kernel failed there on 2026-12-04; head_dim 64 compiles the same code with other constexprs, left to the
    venv's Triton: CI time)."""
    assert OLDEST_TRITON_DIR.is_dir(), f"{OLDEST_TRITON_DIR} is missing: run scripts/setup.sh"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OLDEST_TRITON_DIR), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    child = subprocess.run([sys.executable, "-c", _OLDEST_CHILD], env=env, capture_output=True, text=True,
                           timeout=900, cwd=Path(__file__).parents[2])  # the repository root: tests.* import
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["triton"] == OLDEST_TRITON and Path(report["file"]).is_relative_to(OLDEST_TRITON_DIR), report
    expected = [[c.name, 128] for c in aot_cases.CASES if c.name.startswith("kvfold")]
    assert [row[:2] for row in report["rows"]] == expected
    assert all(row[2] > 0 for row in report["rows"])  # each compiled and its main loop counted
    assert sorted(report["writes"]) == ["_copy_kernel", "_encode_kernel", "_scatter_kernel"]
    assert all(k["registers"] <= 128 and k["spills"]["ldl_stl_instructions"] == 0 for k in report["writes"].values())
