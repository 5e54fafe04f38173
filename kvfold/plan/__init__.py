"""Stage 4, plan: per-head ranks (ranks.py) or bit widths (bits.py) from a removal rate, the accuracy target
(criteria.py), and the search for the largest compression meeting it (search.py, targets.py), kept only
where the long-context pass keys survive (longrange.py)."""
