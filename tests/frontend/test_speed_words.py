"""The UI's words for measured speed (``frontend.speed``): pure functions of an evaluation's summary."""

from __future__ import annotations

from frontend.speed import (close_phases, kernel_words, phase_speedup, phase_text, phase_title, predicted_cell,
                            predicted_speed_words, slower_phases, speed_cell, teal_wins, teal_words)
from moelab.engine.evaluation.kernel_gain import NAME as KERNEL_DENSE


def _summary(conv: dict[str, float], teal: dict[str, float] | None, ppl: dict[str, float]) -> dict:
    names = {"converted": conv, **({"teal": teal} if teal else {})}
    phases = {p: {"seconds": {"dense": 0.1, **{n: 0.1 / v[p] for n, v in names.items()}},
                  "speedup": {"dense": 1.0, **{n: v[p] for n, v in names.items()}},
                  "batch": 8 if p == "decode_b8" else 1, "tokens": 512 if p == "prefill" else None}
              for p in ("decode_b1", "decode_b8", "prefill")}
    return {"variants": {"dense": {"perplexity": 10.0}, **{n: {"perplexity": 10.0 * r} for n, r in ppl.items()}},
            "speed": {"phases": phases, "device": "cpu: x86_64", "dtype": "float32", "threads": 2,
                      "runtime": "PyTorch eager", "protocol": {"repeats": 3}}}


CONV = {"decode_b1": 1.20, "decode_b8": 1.10, "prefill": 0.95}


def test_teal_is_said_to_win_only_where_it_is_faster_and_no_worse():
    s = _summary(CONV, {"decode_b1": 1.45, "decode_b8": 0.80, "prefill": 0.85}, {"converted": 1.9, "teal": 1.02})
    assert phase_speedup(s, "decode_b1", "teal") == 1.45 and speed_cell(s, "teal") == "1.45× / 0.80× / 0.85×"
    assert teal_wins(s) == ["decode_b1"]
    assert teal_words(s) == "1.45× / 0.80× / 0.85×, ppl 1.02× dense — better and faster than the conversion in decode b1"
    slower = _summary(CONV, {"decode_b1": 1.0, "decode_b8": 0.8, "prefill": 0.8}, {"converted": 1.9, "teal": 1.02})
    assert teal_wins(slower) == [] and teal_words(slower).endswith("— better than the conversion, not faster")
    worse = _summary(CONV, {"decode_b1": 1.45, "decode_b8": 1.2, "prefill": 1.2}, {"converted": 1.2, "teal": 1.5})
    assert teal_wins(worse) == [] and teal_words(worse) == "1.45× / 1.20× / 1.20×, ppl 1.50× dense"
    assert teal_words(_summary(CONV, None, {"converted": 1.9})) == ""


def test_a_phase_hover_names_every_timed_model():
    s = _summary(CONV, {"decode_b1": 2.0, "decode_b8": 0.5, "prefill": 1.0}, {"converted": 1.9, "teal": 1.02})
    title = phase_title(s, "decode_b1")
    assert title.startswith("one decode step of batch 1: dense 100.0 ms, converted 83.3 ms, TEAL 50.0 ms; cpu: x86_64")


def test_a_phase_hover_gives_the_ratio_of_every_round():
    """The stored rounds (dense 0.9, 1.0, 1.1 s against 1.0, 1.0, 1.0 s) read back as one ratio a round: a median
    whose rounds ran 0.90-1.10× is within the machine's drift, and the hover shows it."""
    s = _summary(CONV, None, {"converted": 1.9})
    s["speed"]["phases"]["prefill"]["rounds"] = {"dense": [0.9, 1.0, 1.1], "converted": [1.0, 1.0, 1.0]}
    assert "; converted over dense by round 0.90×, 1.00×, 1.10×; cpu: x86_64" in phase_title(s, "prefill")
    assert "by round" not in phase_title(s, "decode_b1")  # no rounds kept: nothing added


def test_a_median_below_dense_says_how_many_of_its_rounds_were():
    """'(slower)' where every round was slower than dense (or none was kept); where some round was not, how many
    were: a median of 0.98x whose rounds ran 0.97-1.02x is not a model slower than dense."""
    s = _summary(CONV, None, {"converted": 1.9})  # prefill 0.95x, no rounds kept
    assert phase_text(s, "prefill") == "0.95× (slower)" and phase_text(s, "decode_b1") == "1.20×"
    phases = s["speed"]["phases"]
    phases["prefill"]["rounds"] = {"dense": [0.97, 0.98, 1.02], "converted": [1.0, 1.0, 1.0]}
    phases["prefill"]["speedup"]["converted"] = 0.98
    assert phase_text(s, "prefill") == "0.98× (slower in 2 of 3 rounds)"
    phases["prefill"]["rounds"]["dense"] = [0.90, 0.95, 0.99]
    phases["prefill"]["speedup"]["converted"] = 0.95
    assert phase_text(s, "prefill") == "0.95× (slower)"


def test_a_timing_on_a_busy_machine_says_so_in_the_cell_and_its_hover():
    """``others_cpu_share`` (the CPUs other processes took while the models were timed) from 10% on marks the ratios
    as measured on a busy machine; below it, and in timings from before it was recorded, nothing is added."""
    quiet, busy, old = (_summary(CONV, None, {"converted": 1.9}) for _ in range(3))
    quiet["speed"]["others_cpu_share"], busy["speed"]["others_cpu_share"] = 0.04, 0.48
    assert speed_cell(quiet) == speed_cell(old) == "1.20× / 1.10× / 0.95×"
    assert speed_cell(busy) == "1.20× / 1.10× / 0.95× (busy machine)"
    assert "busy machine" not in phase_title(quiet, "prefill") and "busy machine" not in phase_title(old, "prefill")
    assert "timed on a busy machine: other processes took 48% of the CPUs" in phase_title(busy, "prefill")


def test_a_prediction_says_its_numbers_and_slower_phases_or_why_there_is_none():
    predicted = {"machine": "cpu: x", "dtype": "float32", "threads": 2, "note": "from measured kernel times",
                 "phases": {"decode_b1": {"speedup": 1.21}, "decode_b8": {"speedup": 0.85}, "prefill": {"speedup": 0.7}}}
    assert slower_phases(predicted) == ["decode_b8", "prefill"]
    assert predicted_speed_words(predicted) == (
        "Predicted speed × dense: decode b1 1.21×, decode b8 0.85×, prefill 0.70× — slower than dense in decode b8 and "
        "prefill (cpu: x, float32, 2 threads; from measured kernel times).")
    streamed = {"phases": {}, "note": "only this model's FFN layers were timed on this machine"}
    assert slower_phases(streamed) == []
    assert predicted_speed_words(streamed) == (
        "Predicted speed × dense: none (only this model's FFN layers were timed on this machine).")
    assert predicted_speed_words({"phases": {}}) == ""


def test_a_phase_predicted_within_the_predictions_error_of_dense_is_said_to_be_close():
    """A phase predicted faster than dense by less than PREDICTION_ERROR (5%) may measure slower: the words and the
    cell say so, beside a slower phase or alone; 1.05x and above is not close."""
    words = {"machine": "cpu: x", "dtype": "float32", "threads": 2, "note": "from measured kernel times"}
    close = {**words, "phases": {"decode_b1": {"speedup": 1.21}, "decode_b8": {"speedup": 1.049}, "prefill": {"speedup": 1.0}}}
    assert close_phases(close) == ["decode_b8", "prefill"] and slower_phases(close) == []
    assert predicted_speed_words(close) == (
        "Predicted speed × dense: decode b1 1.21×, decode b8 1.05×, prefill 1.00× — no phase slower than dense, but "
        "within the prediction's 5% error of dense in decode b8 and prefill: it may measure slower (cpu: x, float32, "
        "2 threads; from measured kernel times).")
    assert predicted_cell({"predicted_speed": close})[0] == "1.21× / 1.05× / 1.00× (close to dense)"
    both = {**words, "phases": {"decode_b1": {"speedup": 1.02}, "decode_b8": {"speedup": 1.05}, "prefill": {"speedup": 0.97}}}
    assert close_phases(both) == ["decode_b1"] and slower_phases(both) == ["prefill"]
    assert "— slower than dense in prefill and within the prediction's 5% error of dense in decode b1:" in predicted_speed_words(both)
    assert predicted_cell({"predicted_speed": both})[0] == "1.02× / 1.05× / 0.97× (slower)"


def test_a_conversions_predicted_speed_cell_says_each_phase_and_why_there_is_none():
    predicted = {"machine": "cpu: x", "dtype": "float32", "threads": 2, "note": "from measured kernel times",
                 "phases": {"decode_b1": {"speedup": 1.46}, "decode_b8": {"speedup": 1.31}, "prefill": {"speedup": 0.92}}}
    text, hover = predicted_cell({"predicted_speed": predicted})
    assert text == "1.46× / 1.31× / 0.92× (slower)" and hover == predicted_speed_words(predicted)
    assert "slower than dense in prefill" in hover
    streamed = {"phases": {}, "note": "only this model's FFN layers were timed on this machine"}
    assert predicted_cell({"predicted_speed": streamed}) == ("–", predicted_speed_words(streamed))
    assert predicted_cell({"ffn_flops_fraction": 0.5}) == ("", "") and predicted_cell(None) == ("", "")


def test_the_kernel_baseline_says_its_speed_and_the_conversions_over_it():
    """The dense model in moelab's kernels: its speed over dense per phase, then the conversion's over it (from the
    rounds), '(slower)' where the conversion loses to it; the reason where it was not timed."""
    s = _summary(CONV, None, {"converted": 1.9})
    rounds = {"decode_b1": ([0.10, 0.10, 0.10], [0.08, 0.08, 0.07], [0.05, 0.08, 0.07]),  # dense, kernels, converted
              "decode_b8": ([0.10] * 3, [0.08] * 3, [0.09] * 3), "prefill": ([1.0] * 3, [1.0] * 3, [0.95] * 3)}
    for phase, (dense, kern, conv) in rounds.items():
        entry = s["speed"]["phases"][phase]
        entry["rounds"] = {"dense": dense, KERNEL_DENSE: kern, "converted": conv}
        entry["speedup"][KERNEL_DENSE] = sorted(d / k for d, k in zip(dense, kern))[1]
        entry["seconds"][KERNEL_DENSE] = sorted(kern)[1]
    # decode b1: kernels 1.25× dense; the conversion over them median(1.6, 1.0, 1.0) = 1.00×
    assert kernel_words(s) == "1.25× / 1.25× / 1.00×; the conversion over it 1.00× / 0.89× / 1.05× (slower)"
    assert "dense in moelab's kernels 80.0 ms" in phase_title(s, "decode_b1")
    s["speed"]["phases"]["decode_b8"]["rounds"][KERNEL_DENSE] = [0.095] * 3
    s["speed"]["phases"]["decode_b8"]["speedup"][KERNEL_DENSE] = 0.1 / 0.095
    assert kernel_words(s) == "1.25× / 1.05× / 1.00×; the conversion over it 1.00× / 1.06× / 1.05×"
    none = _summary(CONV, None, {"converted": 1.9})
    assert kernel_words(none) == ""
    none["speed"]["kernel_dense_note"] = "moelab's kernels run float32 on the CPU; this model is bfloat16 on cuda"
    assert kernel_words(none) == "not timed: moelab's kernels run float32 on the CPU; this model is bfloat16 on cuda"


def test_a_timing_of_an_export_with_an_older_runtime_says_so_in_the_cell_and_its_hover():
    """An evaluation of an export whose runtime is older than moelab's (``old_runtime``, with the re-export to run):
    the speed cell is marked and the hover says why and what to run; a timing with the current runtime adds nothing."""
    current, old = (_summary(CONV, None, {"converted": 1.9}) for _ in range(2))
    old["speed"]["old_runtime"] = "an older runtime: runs/c1 carries … `moelab export runs/c1 --format moelab --out NEW` …"
    assert speed_cell(current) == "1.20× / 1.10× / 0.95×"
    assert speed_cell(old) == "1.20× / 1.10× / 0.95× (older runtime)"
    assert "moelab export runs/c1 --format moelab --out NEW" in phase_title(old, "prefill")
    assert "older runtime" not in phase_title(current, "prefill")
    old["speed"]["others_cpu_share"] = 0.48
    assert speed_cell(old) == "1.20× / 1.10× / 0.95× (busy machine, older runtime)"
