"""kvfold-runtime: serve checkpoints written by `kvfold export`.

`import kvfold_runtime` registers the KVFold<Arch> classes with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(EXPORTED_DIR)` returns a model whose cache stores the
compressed keys and values. Public API: `register`, `runtime_class`, `kv_cache_bytes`, `model_dims`,
`reference_attention`, `sdpa_attention`.
"""

from kvfold_runtime.cache import kv_cache_bytes
from kvfold_runtime.dims import LayerDims, model_dims
from kvfold_runtime.hf import register, runtime_class, runtime_class_name
from kvfold_runtime.kernels import reference_attention, sdpa_attention

__version__ = "0.1.0"
__all__ = ["LayerDims", "kv_cache_bytes", "model_dims", "reference_attention", "register", "runtime_class",
           "runtime_class_name", "sdpa_attention"]

register()
