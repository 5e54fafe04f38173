"""kvfold: compile a HuggingFace decoder LLM into a checkpoint whose KV cache is smaller."""

__version__ = "0.1.0"
__all__ = ["__version__"]
