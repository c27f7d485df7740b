"""Stage 1, derive: model file -> spec -> SymPy derivation -> LaTeX and generated kernels.

The only stage that imports SymPy."""
