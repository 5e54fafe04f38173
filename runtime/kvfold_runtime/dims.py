"""Moved to kvfold_runtime.format (kept until every importer has moved; removed in the same change)."""

from kvfold_runtime.format import LayerDims, model_dims

__all__ = ["LayerDims", "model_dims"]
