"""kvfold-runtime: serve checkpoints written by `kvfold export`.

`import kvfold_runtime` registers the KVFold<Arch> classes with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(EXPORTED_DIR)` returns a model whose cache stores the
compressed keys and values. Public API: `register`, `kv_cache_bytes`, `model_dims`,
`reference_attention`, `sdpa_attention`, `RUNTIME_CLASSES`.
"""

from kvfold_runtime.cache import kv_cache_bytes
from kvfold_runtime.dims import LayerDims, model_dims
from kvfold_runtime.hf import RUNTIME_CLASSES, register, runtime_class_name
from kvfold_runtime.kernels import reference_attention, sdpa_attention

__version__ = "0.1.0"
__all__ = ["RUNTIME_CLASSES", "LayerDims", "kv_cache_bytes", "model_dims", "reference_attention", "register",
           "runtime_class_name", "sdpa_attention"]

register()
