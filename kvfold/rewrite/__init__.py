"""Stage 5, rewrite: the chosen factors baked into the model's weights (bake.py)."""
