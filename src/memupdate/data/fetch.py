"""Get a public data file by URL or local path, verified by sha256.

Search order: (1) ``mirrors``, folders that may already hold a copy named ``filename`` (a shared
data folder on a cluster, or ``../shared/data`` on the project's CI machines); (2) ``source`` itself
when it is a local path or ``file://`` URL; (3) a download over HTTPS. Every candidate is checked
against ``sha256`` before it is copied, and the copy is atomic.
"""

from __future__ import annotations

import logging
import shutil
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from memupdate.utils.io import atomic_path, sha256_file

logger = logging.getLogger(__name__)


class ChecksumMismatch(ValueError):
    """A candidate file does not have the expected sha256."""


def _verify(path: Path, sha256: str | None, origin: str) -> str:
    actual = sha256_file(path)
    if sha256 is not None and actual != sha256.lower():
        raise ChecksumMismatch(
            f"{origin}: sha256 is {actual}, expected {sha256}. The file differs from the published one; "
            "fix the path or the expected hash in config/config.yaml."
        )
    return actual


def _download(url: str, dest: Path, timeout_s: float) -> None:
    request = urllib.request.Request(url, headers={"User-Agent": "memupdate"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=Path(urllib.parse.urlparse(url).path).name) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))


def fetch_file(
    source: str,
    dest: str | Path,
    *,
    sha256: str | None,
    filename: str | None = None,
    mirrors: Sequence[str | Path] = (),
    timeout_s: float = 60.0,
) -> dict:
    """Place a verified copy of ``source`` at ``dest`` and return where it came from and its hash."""
    dest = Path(dest)
    name = filename or Path(urllib.parse.urlparse(source).path).name
    for mirror in mirrors:
        candidate = Path(mirror) / name
        if candidate.is_file():
            try:
                actual = _verify(candidate, sha256, str(candidate))
            except ChecksumMismatch as exc:
                logger.warning("skipping mirror copy: %s", exc)
                continue
            with atomic_path(dest) as tmp:
                shutil.copyfile(candidate, tmp)
            logger.info("copied %s from mirror %s", name, candidate)
            return {"origin": str(candidate), "sha256": actual}

    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("", "file"):
        local = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else source)
        if not local.is_file():
            raise FileNotFoundError(f"{local}: data file not found; set its path or URL in config/config.yaml")
        actual = _verify(local, sha256, str(local))
        with atomic_path(dest) as tmp:
            shutil.copyfile(local, tmp)
        return {"origin": str(local), "sha256": actual}

    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{source}: unsupported URL scheme {parsed.scheme!r} (use https:// or a path)")
    with atomic_path(dest) as tmp:
        logger.info("downloading %s", source)
        try:
            _download(source, tmp, timeout_s)
        except OSError as exc:
            raise ConnectionError(
                f"could not download {source}: {exc}. Download it by hand and set its path in "
                "config/config.yaml, or add a folder holding it to data.mirrors."
            ) from exc
        actual = _verify(tmp, sha256, source)
    if sha256 is None:
        logger.warning("%s has no expected sha256 in config; its sha256 is %s", source, actual)
    return {"origin": source, "sha256": actual}
