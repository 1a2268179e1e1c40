"""What the UI proposes before the user chooses: the calibration that generalised best out of domain.

Measured with ``tests/benchmarks/bench_calibration_choice.py`` (docs/quality.md, "Which calibration"):
``--recipe best`` calibrated on a mix of several sources holds up on a domain left out of it far
better than calibrated on one source, and 60 or 240 samples of the mix score alike once the fit
reads its 16,384 tokens; 240 keeps the profile's statistics (CV, similarity) steadier.
"""

CALIBRATION_SET = "mixed"
CALIBRATION_SAMPLES = 240
CALIBRATION_TOKENS = 256  # max tokens per sample when profiling
CALIBRATION_NOTE = ("Proposed: builtin:mixed, 240 samples × 256 tokens. Calibrated on a mix, a conversion holds up on "
                    "text it never saw; calibrated on one source it does not (docs/quality.md, which calibration).")


def default_builtin(names: list[str]) -> str | None:
    """The proposed built-in set among ``names`` (the server's), else the first one, else None."""
    return CALIBRATION_SET if CALIBRATION_SET in names else (names[0] if names else None)
