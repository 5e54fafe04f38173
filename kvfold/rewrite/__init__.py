"""Stage 3, rewrite: per-head factors from statistics (factors/), then weights baked with them."""
