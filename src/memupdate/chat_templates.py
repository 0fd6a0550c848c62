"""Chat templates shipped with the repository, looked up by name.

Templates live in ``chat_template_files/<name>.jinja`` beside this module (package data), reviewed and
versioned with the code; ``prepare_model`` copies the chosen one into each checkpoint's
tokenizer, so a prepared model never needs this folder again.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().with_name("chat_template_files")


def available_chat_templates() -> list[str]:
    """Names accepted by :func:`load_chat_template`."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def load_chat_template(name: str) -> str:
    """Return the Jinja source of the template ``name`` (file name without ``.jinja``).

    >>> "<tool_call>" in load_chat_template("chatml_tools")
    True
    """
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(
            f"no chat template {name!r}: {path} does not exist; available: {available_chat_templates()}"
        )
    return path.read_text(encoding="utf-8")
