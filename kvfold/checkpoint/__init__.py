"""Stage 4, writing: the versioned manifest and the exported HF directory."""
