"""Stage 4, plan: per-head ranks (ranks.py) or bit widths (bits.py) from a removal rate, the accuracy target
(criteria.py), and the search for the largest compression meeting it (search.py, targets.py), each candidate a
scored Point (point.py), kept only where the long-context pass keys survive (longrange.py). Everything that differs
between the cache formats (rank, bits) is one class per format (formats/), registered by name. The export's options
are a Recipe (recipe.py); planner.plan_export turns checked inputs (reuse.py, which also answers --reuse-curve)
into one ExportPlan value (export_plan.py) that export bakes and the manifest records."""
