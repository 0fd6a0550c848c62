"""The docs name only what exists: every repository path, module, source file and relative link that README.md and
docs/*.md name in code spans or links (outputs under results/ and the shared notes beside the clone are not
checked: a fresh clone has neither)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: The repository's folders a doc names paths in.
FOLDERS = ("src/", "rules/", "workflow/", "config/", "docs/", "tests/", "profiles/", "constraints/", ".ci/")
#: A source file named alone (``settings.py``, ``verl_ext/trainer.py``), with an optional line number.
SOURCE = re.compile(r"`([\w./-]+\.(?:py|smk|yaml|sh|toml|txt|j2))(?::\d+)?`")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def module_resolves(src: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``memupdate.eval.policy`` or ``memupdate.eval.policy.evaluate_policy``) is a module under
    ``src``, or a name that module defines or imports, read from its source (importing would import verl)."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        base = src.joinpath(*parts[:i])
        module = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if module is None:
            continue
        if i == len(parts):
            return True
        name = re.escape(parts[i])
        defined = rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from .+ )?import .*\b{name}\b"
        return re.search(defined, module.read_text(encoding="utf-8"), re.MULTILINE) is not None
    return False


def source_files(repo_root: Path) -> list[str]:
    files = [p for folder in FOLDERS for p in (repo_root / folder).rglob("*") if p.is_file()]
    return [p.relative_to(repo_root).as_posix() for p in files] + [p.name for p in repo_root.glob("*") if p.is_file()]


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in Path(__file__).parents[1].glob("docs/*.md"))])
def test_a_doc_names_only_paths_modules_and_files_that_exist(repo_root, doc):
    path = repo_root / doc if doc == "README.md" else repo_root / "docs" / doc
    text = path.read_text(encoding="utf-8")
    files = source_files(repo_root)
    missing = []
    for span in CODE_SPAN.findall(text):
        named = re.split(r"::|:(?=\d)", span)[0].rstrip(".,")
        if named.startswith(FOLDERS) and not any(c in named for c in "*{<") and not (repo_root / named).exists():
            missing.append(span)
        elif re.fullmatch(r"memupdate(?:\.\w+)+", span) and not module_resolves(repo_root / "src", span):
            missing.append(span)
    for name in SOURCE.findall(text):
        # Outputs, the shared notes and verl's own files are not this repository's.
        if not name.startswith(("results/", "../", "verl/")) and not any(
            f == name or f.endswith(f"/{name}") for f in files
        ):
            missing.append(name)
    for link in LINK.findall(text):
        if not link.startswith(("http://", "https://", "mailto:")) and not (path.parent / link).exists():
            missing.append(f"link {link}")
    assert not missing, f"{doc} names what does not exist: {list(dict.fromkeys(missing))}"


def test_the_check_finds_a_module_that_is_gone(repo_root):
    src = repo_root / "src"
    assert module_resolves(src, "memupdate.eval.policy") and module_resolves(
        src, "memupdate.eval.policy.evaluate_policy"
    )
    assert module_resolves(src, "memupdate.data.headroom.missing_evidence_rank")
    assert not module_resolves(src, "memupdate.eval.html_report") and not module_resolves(
        src, "memupdate.eval.policy.nope"
    )
