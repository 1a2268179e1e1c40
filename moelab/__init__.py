"""moelab: dense GLU LLM -> Mixture-of-Experts, with the analysis to see why."""

from moelab.openmp import limit_spinning

__version__ = "0.1.0"

limit_spinning()  # before anything imports torch: libgomp reads it once (see moelab/openmp.py)
