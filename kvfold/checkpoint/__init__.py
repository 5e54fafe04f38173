"""Stage 6, writing: the versioned manifest and the exported HF directory."""
