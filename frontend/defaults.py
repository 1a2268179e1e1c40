"""What the UI proposes before the user chooses: the calibration that generalised best out of domain.

Measured with ``tests/benchmarks/bench_calibration_choice.py`` (docs/quality.md, "Which calibration"),
``--recipe best`` at 0.75 with the code and the literature domains left out in turn: calibrated on a mix
of the other sources it scores 1.32x dense on the other three domains, calibrated on one source (prose)
1.64x; on the left-out domain the two are close (1.62x and 1.57x; prose, the stdlib's docstrings, suits
code). 60 or 240 samples of the mix score alike (1.33x / 1.32x) once the fit reads its 16,384 tokens;
240 keeps the profile's statistics (CV, similarity) steadier.
"""

CALIBRATION_SET = "mixed"
CALIBRATION_SAMPLES = 240
CALIBRATION_TOKENS = 256  # max tokens per sample when profiling
CALIBRATION_NOTE = ("Proposed: builtin:mixed, 240 samples × 256 tokens. Calibrated on a mix of sources, a conversion holds "
                    "up across text (1.32× dense at cost 0.75); calibrated on one source it suits text like that source "
                    "and loses on the rest (1.64×) (docs/quality.md, which calibration).")


def default_builtin(names: list[str]) -> str | None:
    """The proposed built-in set among ``names`` (the server's), else the first one, else None."""
    return CALIBRATION_SET if CALIBRATION_SET in names else (names[0] if names else None)
