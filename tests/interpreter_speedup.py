"""A pytest plugin for the children that run kernels in Triton's interpreter (conftest.rerun_in_triton_interpreter).

Triton 3.9's interpreter patches triton.language for a kernel's grid (and restores it after), and patches it again on
every call of a @triton.jit helper from inside the kernel: inspect.getmembers over the module, ~4 ms a call. The
kernels call their shared helpers (unpacking, the online-softmax block) in their loops: one windowed page test made
10,955 such calls, 44 s of its 75 s. Here a helper's call skips that second patch when every triton.language module
it sees is already patched (the grid's patch is in place); the grid's own patch and restore are unchanged. Where a
Triton release renames what this wraps, the plugin does nothing and the children run as before, only slower.
"""

from __future__ import annotations

import triton.language as tl
from triton.runtime import interpreter


def _already_patched(fn) -> bool:
    langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
    return bool(langs) and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs)


if hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope"):
    _patch_lang = interpreter._patch_lang

    def _patch_once(fn):
        return interpreter._LangPatchScope() if _already_patched(fn) else _patch_lang(fn)

    interpreter._patch_lang = _patch_once
