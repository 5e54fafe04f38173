"""Reading a kernel's compiled SASS (sm_90) without a GPU: its main loop's instructions, its global loads, its
spills, and how many of its programs an SM holds. Used by kvfold_bench.aot (`kvfold-bench kernels --aot sm_90`).

The disassembly is `nvdisasm -c` of the cubin (the tool Triton's wheel ships under triton/backends/nvidia/bin); the
registers come from `cuobjdump -res-usage`. A loop is a backward branch: a BRA (predicated or not) to a label at
or before it; its body is every instruction from the label to the branch, counted once each, whatever path a pass
takes through them (a predicated-off or branched-over instruction counts too). The main loop is the loop with the
most instructions; for the decode kernels here that is their key loop (one loop, no nesting).
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["SM90", "Loop", "Sass", "disassemble", "load_bytes", "programs_per_sm", "shared_bytes", "tools"]

# H100 / H200 (sm_90) per-SM limits: registers, shared memory (bytes, the 1 KB CUDA reserves per program included),
# resident warps and programs; registers are allocated per warp in units of 256
SM90 = dict(registers=65536, shared=228 * 1024, warps=64, programs=32, reserved_shared=1024, register_unit=256)

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_LOAD = re.compile(r"\b(LDGSTS|LDG)(?![A-Z])((?:\.[A-Z0-9_]+)*)")  # not LDGDEPBAR (a barrier)
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
# shared memory moved by a thread: stores and loads (STS, LDS) and the matrix loads and stores that feed the tensor
# cores (LDSM, STSM: .M88.n or .MT88.n, n 8×8 matrices of 16-bit numbers a warp, 4·n bytes a thread)
_SHARED = re.compile(r"\b(LDSM|STSM|LDS|STS)(?![A-Z])((?:\.[A-Z0-9_]+)*)")
_MATRICES = re.compile(r"\.MT?88\.(\d)")


def tools() -> dict[str, Path]:
    """nvdisasm and cuobjdump as Triton finds them (its wheel ships both with ptxas); KVFoldError if missing."""
    import triton.knobs

    found, missing = {}, []
    for name in ("ptxas", "nvdisasm", "cuobjdump"):
        try:
            path = getattr(triton.knobs.nvidia, name).path
        except Exception:  # a knob that finds nothing raises: missing
            path = None
        if path is None or not Path(path).is_file():
            missing.append(name)
        else:
            found[name] = Path(path)
    if missing:
        raise KVFoldError(f"this Triton install has no {', '.join(missing)} (Triton's NVIDIA wheel ships them under "
                          "triton/backends/nvidia/bin): install the triton wheel for Linux x86-64 or aarch64")
    return found


def shared_bytes(op: str) -> int:
    """Bytes one thread moves in one shared-memory instruction: STS.128 16, LDS.U16 2, LDSM.16.M88.4 16."""
    if m := _MATRICES.search(op):
        return 4 * int(m.group(1))
    return load_bytes(op)


def load_bytes(op: str) -> int:
    """Bytes one thread moves in one global load, from its opcode: LDG.E.U8 1, LDG.E 4, LDG.E.128 16."""
    mods = op.split(".")[1:]
    return next((_WIDTH[m] for m in mods if m in _WIDTH), 4)


@dataclass(frozen=True)
class Loop:
    start: int  # address of its first instruction (the branch target)
    end: int  # address of the backward branch
    instructions: int  # from start to end, both included
    nops: int
    loads: dict[str, int] = field(default_factory=dict)  # global load opcode -> count in the body
    local_memory: int = 0  # LDL/STL in the body: spilled registers
    shared: dict[str, int] = field(default_factory=dict)  # shared-memory opcode -> count in the body

    @property
    def shared_bytes(self) -> int:
        """Shared memory one thread moves in a pass of the body (stores and loads): on sm_90 it shares the L1's
        bandwidth (128 bytes a clock an SM) with the global loads, so a tile staged there costs L1 time per byte."""
        return sum(shared_bytes(op) * n for op, n in self.shared.items())

    @property
    def widest_load(self) -> int:
        return max((load_bytes(op) for op in self.loads), default=0)

    @property
    def narrowest_load(self) -> int:
        return min((load_bytes(op) for op in self.loads), default=0)


@dataclass(frozen=True)
class Sass:
    """One kernel's disassembly: (address, instruction) pairs and the labels' addresses."""
    instructions: list[tuple[int, str]]
    labels: dict[str, int]

    @classmethod
    def parse(cls, text: str) -> Sass:
        instructions, labels, pending = [], {}, []
        for line in text.splitlines():
            if m := _LABEL.match(line.strip()):
                pending.append(m.group(1))
            elif m := _INSTR.match(line):
                addr = int(m.group(1), 16)
                for name in pending:
                    labels[name] = addr
                pending = []
                instructions.append((addr, m.group(2)))
        for name in pending:  # a label after the last instruction
            labels[name] = instructions[-1][0] + 16 if instructions else 0
        return cls(instructions, labels)

    def _span(self, start: int, end: int) -> list[str]:
        return [text for addr, text in self.instructions if start <= addr <= end]

    def loops(self) -> list[Loop]:
        """Every backward branch's span, largest first (a branch to itself, the trap after EXIT, is not a loop)."""
        found = []
        for addr, text in self.instructions:
            m = _BRANCH.search(text)
            if m and m.group(1) in self.labels and self.labels[m.group(1)] < addr:
                found.append(self._loop(self.labels[m.group(1)], addr))
        return sorted(found, key=lambda loop: -loop.instructions)

    def _loop(self, start: int, end: int) -> Loop:
        body = self._span(start, end)
        loads = Counter(m.group(1) + m.group(2) for t in body if (m := _LOAD.search(t)))
        shared = Counter(m.group(1) + m.group(2) for t in body if (m := _SHARED.search(t)))
        return Loop(start, end, len(body), sum(1 for t in body if t.split()[-1] == "NOP"),
                    dict(sorted(loads.items())), sum(1 for t in body if re.search(r"\b(LDL|STL)\b", t)),
                    dict(sorted(shared.items())))

    def main_loop(self) -> Loop | None:
        loops = self.loops()
        return loops[0] if loops else None

    @property
    def local_memory(self) -> int:
        """LDL/STL instructions in the whole kernel (spills and their reloads)."""
        return sum(1 for _, t in self.instructions if re.search(r"\b(LDL|STL)\b", t))


def disassemble(cubin: bytes) -> tuple[str, dict[str, int]]:
    """(nvdisasm -c text, cuobjdump -res-usage fields of the kernel: REG, STACK, SHARED, LOCAL) of a cubin."""
    paths = tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(paths["nvdisasm"]), "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout
        usage = subprocess.run([str(paths["cuobjdump"]), "-res-usage", str(path)], check=True, capture_output=True,
                               text=True).stdout
    function = usage.split("Function", 1)[-1]
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", function)}
    return text, fields


def programs_per_sm(registers: int, shared: int, num_warps: int, limits: dict = SM90) -> dict[str, int]:
    """Programs (CTAs) one SM holds, and what bounds it: registers (per warp, rounded up to 256), shared memory
    (plus the 1 KB reserved per program), warps, programs."""
    per_warp = math.ceil(max(registers, 1) * 32 / limits["register_unit"]) * limits["register_unit"]
    bounds = {"registers": limits["registers"] // per_warp // num_warps,
              "shared": limits["shared"] // (shared + limits["reserved_shared"]),
              "warps": limits["warps"] // num_warps, "programs": limits["programs"]}
    n = min(bounds.values())
    return {"programs": n, "warps": n * num_warps, "bound": min(bounds, key=bounds.get)}
