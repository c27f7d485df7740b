"""Attention-indexed models (AIM) at extensive width: spectral prior (RIE), output channels,
state evolution, thresholds, AMP, gradient descent, deep (two-layer) AIM.

See docs/aim.md and theory.md section 7.
"""

from .spectral import density, rie_map, rie_mmse, stieltjes, support_edges  # noqa: F401
