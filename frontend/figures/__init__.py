"""Plotly figures as pure functions of the API's chart JSON (no I/O, no Dash).

Each builder takes the dict an endpoint returned (or plain arrays) and returns a
``go.Figure``; :func:`table` turns the same payload into rows for the CSV download. Heatmaps
are plain ``go.Heatmap`` (never heatmapgl): the API already tiles big maps, and the figure's
title carries its ``note`` when it did.

One module per page (``neurons``, ``layers``, ``designer``, ``routing``, ``compare``, ``evaluations``,
``finetune``, ``calibration``, ``profile_compare``), ``matching`` for the two pages that show matched experts,
``tables`` for the CSV rows and ``common`` for what they share; this package re-exports every name.
"""

from __future__ import annotations

from .common import TEMPLATE, _layout, without_note, MESSAGE_LINE_CHARS, message_figure, LOG_COUNTS, BASIS_NAMES, basis_names, value_histogram, binned_histogram, js_divergence, layer_gaps, heldout_of, heldout_key, heldout_label, wrap_words  # noqa: F401
from .neurons import cv_histogram, cv_by_layer, specialisation_ratio, activation_heatmap, neuron_profile, neuron_card_profile, task_similarity, activation_rate_histogram, h_value_histogram  # noqa: F401
from .layers import blocks, fusion_outline, layer_similarity  # noqa: F401
from .designer import allocation_plan, budget_plan, budget_cap, reconstruction_error  # noqa: F401
from .routing import routing_share, routed_experts, BLANK_NOTE, routing_heatmap, routing_difference, routing_js_line, load_cv_by_layer  # noqa: F401
from .matching import matched_layer, skipped_reason, matched_label, best_match_text, matched_colour_ids, expert_overlap, matching_by_layer, routing_at_matched_ids  # noqa: F401
from .compare import VARIANT_ORDER, VARIANT_COLOURS, perplexity_rows, _bar_label, TICK_LINE_PX, PANEL_PX, compare_perplexity, QUALITY_COST_COLUMNS, KERNELS_LABEL, QUALITY_X, quality_cost_points, DOMAIN_SYMBOLS, DOMAIN_MARKS, TEXT_COLOURS, quality_vs_cost, compare_active  # noqa: F401
from .finetune import finetune_summary_text, finetune_eval_text, finetune_loss  # noqa: F401
from .calibration import calibration_size_unit, calibration_sizes  # noqa: F401
from .profile_compare import SPECIFICITY_SCALE, specificity_scatter, specific_share_bars, specific_rows  # noqa: F401
from .tables import table, csv_text  # noqa: F401
from .evaluations import LAYER_METRICS, js_between, layer_overlay  # noqa: F401
