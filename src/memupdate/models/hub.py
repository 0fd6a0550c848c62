"""Which models come from the Hugging Face hub; imported when the Snakefile loads, so no torch here."""

from __future__ import annotations

from pathlib import Path


def is_hub_id(name_or_path: str) -> bool:
    """Whether an ``hf`` model's ``name_or_path`` is downloaded (no such local folder) rather than read.

    >>> is_hub_id("Qwen/Qwen2.5-7B-Instruct"), is_hub_id(".")
    (True, False)
    """
    return not Path(name_or_path).expanduser().exists()
