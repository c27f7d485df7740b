"""Figures: SE curves and phase diagrams (se), the AIM (aim) and ERM (erm) figures."""
