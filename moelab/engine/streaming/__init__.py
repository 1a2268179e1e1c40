"""Streaming under a memory budget (``--max-memory``): a model whose weights exceed the budget is built on
the ``meta`` device and worked on one decoder layer at a time, its tensors read from the safetensors
shards as each layer needs them and dropped after.

* ``footprint.py``: how much a model needs (``Footprint``: whole model, each layer, the decoder's own
  weights) and ``MemoryBudgetError`` when the budget cannot hold one streamed step.
* ``checkpoint.py``: weights on disk (``weights_location``, ``Checkpoint``: one tensor at a time) and
  loading a module of a meta model from them and back to ``meta`` (``load_module`` / ``unload_module``;
  ``LayerLoader``: the decoder's own weights, then each layer's, around the steps of a layer-by-layer pass).
* ``plan.py``: the model on ``meta`` (``meta_model``, config and tokenizer only) and its footprint
  checked against the budget (``plan_streaming`` → ``StreamPlan``; ``StreamPlan.stream``: whether the
  whole model, and a job's work beside it, exceed it).
* ``profile.py``: the profiler's layer-streamed pass (``profile_streamed``), which yields the
  statistics of ``profiling.profiler.profile_model``.
* ``conversion.py``: the streamed partition conversion (``plan_conversion``, ``convert_streamed``); a fitted
  recipe's fit runs as ``core.fitting``'s layer-by-layer pass with a ``LayerLoader``.

The profiler's streaming is here, not in ``profiling/``: it is the same mechanism as the conversion's
(the same meta model, plan, footprint check, checkpoint reads and per-layer load / unload); only what
runs on each loaded layer differs (the profiler's hooks over every batch, or the partition and fit of its MLP).
``profile.py`` uses the profiler's accumulators (``profiling.profiler``); ``profiling/`` imports nothing
from here.

Whether a conversion can stream (a partition method, nothing that reads the whole model at once) is
``core.params.check_streamable``, and what its fit holds ``core.params.fit_bytes``: rules without torch, which
the API also asks when it takes a request. A conversion asks it once, in ``conversion.plan_conversion``, and
only when the model exceeds the budget; ``convert_streamed`` acts on that plan without checking again.

This package's modules import torch; the package itself imports none of them.
"""
