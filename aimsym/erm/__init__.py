"""Empirical risk minimisation in a single tied attention layer on AIM data (theory.md §8).

- ``se``: asymptotic fixed point (proximal output step + spectral prior step);
- ``thresholds``: perfect recovery / interpolation, closed forms and located on the fixed point;
- ``spectrum``: predicted spectrum of the learned S (and of W / sqrt(d));
- ``target`` / ``freeconv``: target spectral laws (Wishart, power-law eigenvalue groups) and
  their free convolution with a semicircle for the prior side;
- ``scaling``: population limit, excess learning curves and their fitted exponents;
- ``train``: finite-size Adam training of the factorised / direct models;
- ``cli``: ``aimsym erm se|train|spectrum|thresholds|plot``.

See docs/erm.md.
"""

from .params import ERMParams  # noqa: F401
from .se import Accuracy, FixedPoint, fixed_point  # noqa: F401
