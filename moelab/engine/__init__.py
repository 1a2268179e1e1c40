"""The pure ML library behind moelab, laid out like the pipeline.

model adapters (``models``) -> calibration sets (``data``) -> profiling (``profiling``) -> a method
(``methods``: the registry, one module per method, built from the shared primitives in ``core``) ->
the MoE runtime and export (``runtime``) -> evaluation (``evaluation``) -> recovery fine-tuning
(``training``); ``runs`` strings them together for the CLI and the workers.
It imports torch / numpy / transformers only: never FastAPI, Celery or Dash.
"""
