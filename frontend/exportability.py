"""The engine's export words in the UI's: its refusals and export plans (``POST /methods/{method}/export-plan``,
``ConversionOut.gguf``) speak the CLI (``--recipe portable``, ``--format moelab``); a page says the same with its own
controls. The rules themselves live in the engine (``moelab.engine.runtime.export_plan``)."""

from __future__ import annotations

#: the engine's refusals name command-line flags; the UI says the same with its own controls (longest first)
UI_WORDS = (("convert with --recipe portable", "design it with the 'portable' recipe"),
            ("(moelab finetune --mode expertweaver)", "(the Fine-tune page, mode expertweaver)"),
            ("moelab finetune --mode expertweaver", "the Fine-tune page in mode expertweaver"),
            ("use --format moelab", "download it in moelab's format (zip)"),
            ("exports with --format moelab", "downloads in moelab's format (zip)"), ("--format moelab", "moelab's format (zip)"),
            ("--recipe portable", "the 'portable' recipe"), ("--recipe best", "the 'best' recipe"),
            ("convert with --n-experts", "design it with n_experts"), ("--n-experts", "n_experts"))


def ui_words(text: str) -> str:
    """An engine refusal (which speaks the CLI: ``--recipe portable``, ``--format moelab``) in the UI's words."""
    for cli, ui in UI_WORDS:
        text = text.replace(cli, ui)
    return text
