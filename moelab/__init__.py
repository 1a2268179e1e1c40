"""moelab: dense GLU LLM -> Mixture-of-Experts, with the analysis to see why."""

__version__ = "0.1.0"
