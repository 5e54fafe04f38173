"""The two models verify compares, holding the unchanged weights once (issue 52).

An export differs from its source only in each layer's attention projections (and the post-RoPE factors it adds);
every other tensor it writes is the source's, byte for byte. So the served export is loaded first, and the original
is built around the same tensors: each of the source checkpoint's tensors is read alone (one at a time, never the
whole file mapped), cast as loading casts it, and compared with the served model's tensor of that name; where they
are equal the original takes the served model's tensor itself, elsewhere (the projections) the one read. The
original is then a model transformers loaded from that state dict — its class, config, tied weights, buffers and
generation config as `from_pretrained(source)` gives them — so its outputs are the same numbers.

A source without safetensors files is loaded whole (sources.models.load_model): two copies, as before.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn

from kvfold.sources.models import DTYPES, ModelRef, load_model

__all__ = ["load_original_beside", "shared_parameters"]


def load_original_beside(served: nn.Module, ref: ModelRef, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """The source model `ref` in `dtype` on `device`, sharing every tensor it has in common with `served`."""
    files = sorted(ref.path.glob("*.safetensors"))
    if not files:
        return load_model(ref, dtype, device)
    import transformers
    from transformers import AutoConfig, GenerationConfig

    theirs = served.state_dict()
    prefix = getattr(served, "base_model_prefix", "")
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            with safe_open(file, framework="pt") as f:  # opened per tensor: only this tensor's pages are mapped
                tensor = f.get_tensor(name).to(DTYPES[dtype]).to(device)
            same = next((theirs[n] for n in (name, f"{prefix}.{name}") if n in theirs), None)
            if same is not None and same.shape == tensor.shape and same.dtype == tensor.dtype \
                    and torch.equal(same, tensor):
                tensor = same  # the served model's own storage
            state[name] = tensor
    del theirs
    config = AutoConfig.from_pretrained(ref.path)
    cls = getattr(transformers, ref.architecture)
    kwargs = {}
    if (ref.path / "generation_config.json").is_file():  # what from_pretrained(ref.path) would read
        kwargs["generation_config"] = GenerationConfig.from_pretrained(ref.path)
    original = cls.from_pretrained(None, config=config, state_dict=state, dtype=DTYPES[dtype], **kwargs)
    return original.to(device).eval()


def shared_parameters(a: nn.Module, b: nn.Module) -> tuple[int, int]:
    """(parameters of `a` whose storage is `b`'s parameter of the same name, parameters of `a`)."""
    theirs = dict(b.named_parameters())
    mine = dict(a.named_parameters())
    shared = sum(n in theirs and p.data_ptr() == theirs[n].data_ptr() for n, p in mine.items())
    return shared, len(mine)
