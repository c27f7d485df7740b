"""Stage 3, solvers of sequence multi-index models: data, state evolution, thresholds, GAMP, GD."""
