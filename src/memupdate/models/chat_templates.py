"""Chat templates shipped with the repository, looked up by name.

Templates live in ``config/chat_templates/<name>.jinja`` so that they are reviewed and versioned with
the rest of the configuration; ``prepare_model`` copies the chosen one into each checkpoint's
tokenizer, so a prepared model never needs this folder again.
"""

from __future__ import annotations

from pathlib import Path

#: ``src/memupdate/models/chat_templates.py`` -> repository root -> ``config/chat_templates``.
TEMPLATE_DIR = Path(__file__).resolve().parents[3] / "config" / "chat_templates"


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
        if not TEMPLATE_DIR.is_dir():
            raise FileNotFoundError(
                f"chat template folder {TEMPLATE_DIR} does not exist: memupdate must run from a checkout of "
                "the repository (pip install -e .), which keeps config/ beside src/"
            )
        raise FileNotFoundError(
            f"no chat template {name!r}: {path} does not exist; available: {available_chat_templates()}"
        )
    return path.read_text(encoding="utf-8")
