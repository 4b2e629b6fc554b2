"""prism-select: PRISM, preference-aware influence-function data selection.

Pipeline: data -> model -> preference -> gradients -> curvature -> scores -> selection.
"""

__version__ = "0.1.0"
