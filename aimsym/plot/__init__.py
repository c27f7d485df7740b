"""Figures: SE curves and phase diagrams (se), the AIM (aim) and ERM (erm) figures."""

from .se import overlaps, phase_diagram, save_figure  # noqa: F401 (the SE figures, as aimsym.plot.* before)
