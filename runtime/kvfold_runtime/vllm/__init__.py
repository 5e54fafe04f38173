"""kvfold's vLLM plugin: `vllm serve EXPORTED_DIR` / `vllm.LLM(model=EXPORTED_DIR)` with kvfold-runtime installed.

`register()` is the `vllm.general_plugins` entry point (runtime/pyproject.toml). vLLM calls it in every
process it starts (the engine core and workers too); it is idempotent and imports no model code: the
attention backend `KVFOLD` (vllm.v1.attention.backends.registry.register_backend) and one model class
per exported architecture (ModelRegistry.register_model, as lazy "module:Class" strings) are
registered by name and imported by vLLM when an export is loaded. Plain models are untouched.
"""

from __future__ import annotations

import logging

__all__ = ["SUPPORTED_VLLM", "register"]

# The vLLM versions this plugin is tested with; the attention-backend API moves between minor releases.
SUPPORTED_VLLM = (">=0.32,<0.33", (0, 32), (0, 33))

_log = logging.getLogger(__name__)
_done = False


def _version_ok(version: str) -> bool:
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    return SUPPORTED_VLLM[1] <= parts < SUPPORTED_VLLM[2]


def register() -> None:
    """Register the KVFOLD backend and the KVFold<Arch> model classes with vLLM. Idempotent."""
    global _done
    if _done:
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvfold_runtime.families import FAMILIES
    from kvfold_runtime.format import runtime_class_name

    if not _version_ok(vllm.__version__):
        # Never break vLLM for plain models: say why exports will not load, register nothing.
        _log.error("kvfold-runtime serves kvfold exports on vLLM %s; this is vLLM %s: kvfold exports will not "
                   "load (pip install 'vllm%s')", SUPPORTED_VLLM[0], vllm.__version__, SUPPORTED_VLLM[0])
        _done = True
        return
    from kvfold_runtime.vllm.backend import BACKEND_NAME

    path = "kvfold_runtime.vllm.backend.KVFoldAttentionBackend"
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, path)
    for arch in FAMILIES:
        name = runtime_class_name(arch)
        ModelRegistry.register_model(name, f"kvfold_runtime.vllm.models:{name}")
    _done = True
