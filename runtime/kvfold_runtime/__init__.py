"""kvfold-runtime: serve checkpoints written by `kvfold export`.

`import kvfold_runtime` registers the KVFold<Arch> classes with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(EXPORTED_DIR)` returns a model whose cache stores the
compressed keys and values. Public API: `register`, `runtime_class`, `kv_cache_bytes`, `model_dims`,
`check_export`, `reference_attention`, `sdpa_attention`, `paged_attention`, `write_paged`.

`kvfold_runtime.vllm` is vLLM's plugin (entry point `vllm.general_plugins`): with this package installed,
`vllm serve EXPORTED_DIR` and `vllm.LLM(model=EXPORTED_DIR)` serve exports from a paged cache that holds
the compressed widths. It is imported by vLLM, never here (vLLM is optional).
"""

from kvfold_runtime.cache import kv_cache_bytes
from kvfold_runtime.dims import LayerDims, model_dims
from kvfold_runtime.export import check_export
from kvfold_runtime.hf import register, runtime_class, runtime_class_name
from kvfold_runtime.kernels import paged_attention, reference_attention, sdpa_attention, write_paged

__version__ = "0.1.0"
__all__ = ["LayerDims", "check_export", "kv_cache_bytes", "model_dims", "paged_attention", "reference_attention",
           "register", "runtime_class", "runtime_class_name", "sdpa_attention", "write_paged"]

register()
