"""aimsym: symbolic-numeric derivation toolkit for learning in attention models."""

from .errors import AimsymError, ChannelError, SpecError
from .provenance import __version__
from .moved import install as _install_moved

_install_moved()  # old flat module paths still import (aimsym.moved)

__all__ = ["AimsymError", "ChannelError", "SpecError", "load", "__version__"]


def load(source, **parameters):
    """Load a model from a TOML path, a TOML string or a spec; bind symbolic parameters.

    ``aimsym.load("derivations/attention_L2_T2.toml", skip=1.0)`` returns a
    :class:`aimsym.model.Model`.
    """
    from .model import load as _load

    return _load(source, **parameters)
