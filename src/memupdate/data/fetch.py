"""Get a public data file by URL or local path, verified by sha256.

Search order: (0) the store of verified copies by sha256, if given; (1) ``mirrors``, folders that may already hold a copy named ``filename`` (a shared
data folder on a cluster, or ``../shared/data`` on the project's CI machines); (2) ``source`` itself
when it is a local path or ``file://`` URL; (3) a download over HTTPS. Every candidate is checked
against ``sha256`` before it is copied, and the copy is atomic.
"""

from __future__ import annotations

import http.client
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
    """A candidate file does not have the expected sha256 (and no other place held a good copy)."""


class IncompleteDownload(OSError):
    """The server sent fewer bytes than its Content-Length announced."""


def _verify(path: Path, sha256: str | None, origin: str) -> str:
    actual = sha256_file(path)
    if sha256 is not None and actual != sha256.lower():
        raise ChecksumMismatch(f"{origin}: sha256 is {actual}, expected {sha256}")
    return actual


def verify_copy(path: str | Path, sha256: str | None) -> None:
    """Check a fetched copy again where it is read: fetch_data verified it once, but a copy replaced by hand since
    would otherwise be preprocessed as if it were the published file. ``sha256`` None (a local file given by path,
    the only copy allowed one) checks nothing."""
    if sha256 is None:
        return
    actual = sha256_file(path)
    if actual != sha256.lower():
        raise ChecksumMismatch(
            f"{path}: sha256 is {actual}, not the {sha256} config/config.yaml (data.files) gives it: the copy changed "
            "after it was fetched. Delete it and rerun to fetch it again, or fix the expected sha256"
        )


def _download(url: str, dest: Path, timeout_s: float) -> None:
    request = urllib.request.Request(url, headers={"User-Agent": "memupdate"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        received = 0
        with tqdm(total=total, unit="B", unit_scale=True, desc=Path(urllib.parse.urlparse(url).path).name) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    # urllib returns a short body without an error when the server closes early, and without an
    # expected sha256 the length is the only check that the copy is whole.
    if total is not None and received != total:
        raise IncompleteDownload(f"received {received} of the {total} bytes announced (Content-Length)")


def _failure(name: str, sha256: str | None, tried: Sequence[str], advice: str) -> str:
    """One message for a file no place could supply: every place tried, why each failed, what to do."""
    wanted = f"{name} (sha256 {sha256})" if sha256 is not None else name
    return f"could not get {wanted}; tried: " + "; ".join(tried) + f". {advice}."


def fetch_file(
    source: str,
    dest: str | Path,
    *,
    sha256: str | None,
    filename: str | None = None,
    mirrors: Sequence[str | Path] = (),
    timeout_s: float = 60.0,
    store: str | Path | None = None,
) -> dict:
    """Place a verified copy of ``source`` at ``dest`` and return where it came from and its hash.

    ``store``: a folder of verified copies by sha256, looked in first and given every copy verified here. Snakemake
    deletes a rule's output before running it again (a changed ``filename`` or ``data.mirrors`` reruns the fetch),
    so without it an offline rerun would lose the good copy for a fetch that cannot replace it.

    When nothing can supply the file, the error lists every place tried and why it failed (a mirror copy
    with another sha256, a missing file, an unreachable URL with the reason, a short download).
    """
    dest = Path(dest)
    kept = Path(store) / sha256 if store is not None and sha256 is not None else None
    if kept is not None and kept.is_file():
        try:
            actual = _verify(kept, sha256, f"verified copy {kept}")
        except ChecksumMismatch as exc:
            logger.warning("dropping a damaged verified copy: %s", exc)
            kept.unlink()
        else:
            with atomic_path(dest) as tmp:
                shutil.copyfile(kept, tmp)
            logger.info("copied %s from the verified copy %s", dest.name, kept)
            return {"origin": str(kept), "sha256": actual}
    info = _fetch(source, dest, sha256=sha256, filename=filename, mirrors=mirrors, timeout_s=timeout_s)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(kept) as tmp:
            shutil.copyfile(dest, tmp)
    return info


def _fetch(
    source: str,
    dest: Path,
    *,
    sha256: str | None,
    filename: str | None,
    mirrors: Sequence[str | Path],
    timeout_s: float,
) -> dict:
    """:func:`fetch_file` without its store: mirrors, then the source (a path or a download)."""
    name = filename or Path(urllib.parse.urlparse(source).path).name
    tried: list[str] = []
    mirror_mismatch = False
    # A copy found by name can be trusted only by its sha256: without one, only the source itself is used.
    for mirror in mirrors if sha256 is not None else ():
        folder = Path(mirror)
        if not folder.is_dir():
            logger.warning("data mirror folder %s does not exist; skipped (data.mirrors in config/config.yaml)", folder)
            tried.append(f"mirror folder {folder} (does not exist)")
            continue
        candidate = folder / name
        if not candidate.is_file():
            tried.append(f"mirror {candidate} (no such file)")
            continue
        try:
            actual = _verify(candidate, sha256, f"mirror {candidate}")
        except ChecksumMismatch as exc:
            logger.warning("skipping mirror copy: %s", exc)
            tried.append(str(exc))
            mirror_mismatch = True
            continue
        with atomic_path(dest) as tmp:
            shutil.copyfile(candidate, tmp)
        logger.info("copied %s from mirror %s", name, candidate)
        return {"origin": str(candidate), "sha256": actual}

    fix_hash = (
        "A copy differs from the published file: replace it, or fix the expected sha256 in config/config.yaml"
        if mirror_mismatch
        else ""
    )
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("", "file"):
        local = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else source)
        if not local.is_file():
            tried.append(f"{local} (data file not found)")
            raise FileNotFoundError(
                _failure(name, sha256, tried, fix_hash or "Set its path or URL in config/config.yaml")
            )
        try:
            actual = _verify(local, sha256, str(local))
        except ChecksumMismatch as exc:
            tried.append(str(exc))
            raise ChecksumMismatch(
                _failure(name, sha256, tried, "Fix the path or the expected sha256 in config/config.yaml")
            ) from None
        with atomic_path(dest) as tmp:
            shutil.copyfile(local, tmp)
        return {"origin": str(local), "sha256": actual}

    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{source}: unsupported URL scheme {parsed.scheme!r} (use https:// or a path)")
    with atomic_path(dest) as tmp:
        logger.info("downloading %s", source)
        try:
            _download(source, tmp, timeout_s)
        # http.client reports a body cut short in chunked encoding as IncompleteRead, not an OSError.
        except (OSError, http.client.HTTPException) as exc:
            tried.append(f"{source} (download failed: {str(exc) or type(exc).__name__})")
            advice = fix_hash or (
                "Download it by hand and set its path in config/config.yaml"
                + (
                    ", or put it in one of the data.mirrors folders"
                    if mirrors
                    else ", or add a folder holding it to data.mirrors"
                )
            )
            raise ConnectionError(_failure(name, sha256, tried, advice)) from None
        try:
            actual = _verify(tmp, sha256, source)
        except ChecksumMismatch as exc:
            tried.append(str(exc))
            raise ChecksumMismatch(
                _failure(
                    name,
                    sha256,
                    tried,
                    "The download differs from the published file: fix the URL or the expected sha256 in config/config.yaml",
                )
            ) from None
    if sha256 is None:
        logger.warning("%s has no expected sha256 in config; its sha256 is %s", source, actual)
    return {"origin": source, "sha256": actual}
