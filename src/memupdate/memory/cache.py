"""Embedding cache: one vector per distinct text, keyed by the sha256 of the text, as an artifact directory.

Example::

    cache = EmbeddingCache.open("results/embeddings/all-MiniLM-L6-v2/memories", Embedder())
    vectors = cache.ensure(["prefers tea", "likes coffee"])  # embeds only the texts not cached yet
    cache.save()                                             # old directory or new, never half-written

Layout of the directory::

    vectors.npy     float32 [n, dim], unit rows, loaded memory-mapped
    keys.txt        n lines, sha256 hex of the UTF-8 text of each row, in row order
    manifest.json   model name, dim, count, key scheme, created / updated times (UTC)

A cache belongs to one model: opening it for another model (or dim) raises :class:`EmbeddingModelMismatch`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memupdate.memory.embedder import Embedder, canonical_model_name
from memupdate.utils.io import read_parquet_columns, sha256_text, share_like_open, write_json_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
VECTORS_FILE = "vectors.npy"
KEYS_FILE = "keys.txt"
MANIFEST_FILE = "manifest.json"
#: Texts embedded between two saves of a long build. A save rewrites the whole cache (about 1.5 kB
#: per text at dim 384), far cheaper than embedding the texts since the last one.
DEFAULT_CHECKPOINT_EVERY = 1024


class EmbeddingCacheError(RuntimeError):
    """The cache directory is unusable; the message names it and says what to do."""


class EmbeddingModelMismatch(EmbeddingCacheError):
    """The cache was built with another embedding model than the one asked for."""


class MissingEmbeddings(EmbeddingCacheError, LookupError):
    """Some texts have no cached vector (and no embedder was given to compute them)."""

    def __init__(self, message: str, missing: Sequence[str]):
        super().__init__(message)
        self.missing = list(missing)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class EmbeddingCache:
    """sha256(text) → unit float32 vector for one model; see the module docstring for the layout.

    Build one with :meth:`open`. The vectors of a loaded cache are a read-only memory map until new
    texts are added, so every worker on a node shares the same pages.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        model_name: str,
        dim: int,
        vectors: np.ndarray | None = None,
        keys: Sequence[str] = (),
        embedder: Embedder | None = None,
        created_at: str | None = None,
    ):
        self.path = Path(path) if path is not None else None
        self.model_name = canonical_model_name(model_name)
        self.dim = dim
        self.embedder = embedder
        self._vectors = vectors if vectors is not None else np.empty((0, dim), dtype=np.float32)
        self._keys = list(keys)
        self._row = {key: i for i, key in enumerate(self._keys)}
        if self._vectors.shape != (len(self._keys), dim) or len(self._row) != len(self._keys):
            raise EmbeddingCacheError(
                f"embedding cache {self.path}: {self._vectors.shape} vectors for {len(self._keys)} keys "
                f"({len(self._row)} distinct) and dim {dim} do not match"
            )
        self.created_at = created_at or _now()
        # Vectors added since the last consolidation; concatenated once on read instead of per batch.
        self._added: list[np.ndarray] = []
        self._dirty = False

    # ------------------------------------------------------------------ loading

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        embedder: Embedder | None = None,
        *,
        model_name: str | None = None,
        must_exist: bool = False,
    ) -> EmbeddingCache:
        """Load the cache at ``path`` (memory-mapped), or start an empty one there if it does not exist.

        The expected model comes from ``embedder`` or ``model_name``; a cache built with another model or
        dim is refused. Without an embedder the cache can only look vectors up, and must exist.
        """
        path = Path(path)
        if embedder is not None:
            if model_name is not None and canonical_model_name(model_name) != embedder.model_name:
                raise ValueError(f"model_name {model_name!r} contradicts the embedder's {embedder.model_name!r}")
            model_name = embedder.model_name
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            if must_exist or embedder is None:
                raise EmbeddingCacheError(
                    f"no embedding cache at {path} (missing {MANIFEST_FILE}): run the embed_memories rule "
                    "(memupdate.memory.cache.build_embedding_cache) first"
                )
            logger.info("starting an empty embedding cache at %s for %s", path, embedder.model_name)
            return cls(path, model_name=embedder.model_name, dim=embedder.dim, embedder=embedder)

        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise EmbeddingCacheError(f"{manifest_path}: not a manifest ({err}); delete {path} to rebuild it") from None
        if not isinstance(manifest, dict):
            raise EmbeddingCacheError(f"{manifest_path}: not a manifest (a JSON object); delete {path} to rebuild it")
        built_with, built_dim = manifest.get("model_name"), manifest.get("dim")
        wanted_dim = embedder.dim if embedder is not None else built_dim
        if model_name is not None and (canonical_model_name(model_name) != built_with or wanted_dim != built_dim):
            raise EmbeddingModelMismatch(
                f"embedding cache {path} was built with model {built_with!r} (dim {built_dim}), "
                f"but model {canonical_model_name(model_name)!r} (dim {wanted_dim}) was asked for: "
                "use a cache directory per model, or delete this one to rebuild it"
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise EmbeddingCacheError(
                f"embedding cache {path} has format_version {manifest.get('format_version')!r}, "
                f"this code reads {FORMAT_VERSION}: rebuild it"
            )
        try:
            vectors = np.load(path / VECTORS_FILE, mmap_mode="r")
            keys = (path / KEYS_FILE).read_text(encoding="ascii").split()
        except (OSError, ValueError, EOFError) as err:
            # A truncated .npy fails to map ("mmap length is greater than file size").
            raise EmbeddingCacheError(f"embedding cache {path} is damaged ({err}); delete it to rebuild it") from None
        if vectors.dtype != np.float32 or len(keys) != manifest.get("count") or vectors.shape != (len(keys), built_dim):
            raise EmbeddingCacheError(
                f"embedding cache {path} is inconsistent: manifest count {manifest.get('count')}, dim {built_dim}, "
                f"{len(keys)} keys, vectors {vectors.dtype}{list(vectors.shape)}; delete it to rebuild it"
            )
        # Vectors are stored normalised: a row that is not (zeroed, say) would score every query 0 in silence, and
        # one holding a NaN would never be retrieved again (written as "not within", which NaN never is).
        norms = np.einsum("ij,ij->i", vectors, vectors) if len(keys) else np.ones(0, np.float32)
        if (bad := np.flatnonzero(~(np.abs(norms - 1) <= 1e-3))).size:
            raise EmbeddingCacheError(
                f"embedding cache {path}: {bad.size} vectors are not unit length (row {int(bad[0])}: squared norm "
                f"{float(norms[bad[0]]):.3g}); delete it to rebuild it"
            )
        logger.info("loaded embedding cache %s: %d vectors of dim %d (%s)", path, len(keys), built_dim, built_with)
        return cls(
            path,
            model_name=built_with,
            dim=built_dim,
            vectors=vectors,
            keys=keys,
            embedder=embedder,
            created_at=manifest.get("created_at"),
        )

    # ------------------------------------------------------------------ lookup

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and sha256_text(text) in self._row

    @property
    def vectors(self) -> np.ndarray:
        """All vectors, row-aligned with :meth:`keys` (read-only when memory-mapped)."""
        self._consolidate()
        return self._vectors

    def _consolidate(self) -> None:
        if self._added:
            # Leaves the memory map: the rows live in memory until the next open.
            self._vectors = np.concatenate([self._vectors, *self._added])
            self._added = []

    def keys(self) -> list[str]:
        return list(self._keys)

    def get(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors ``[len(texts), dim]`` (an in-memory copy) for texts that are all cached."""
        keys = [sha256_text(t) for t in texts]
        missing = [t for t, k in zip(texts, keys, strict=True) if k not in self._row]
        if missing:
            raise MissingEmbeddings(
                f"{len(missing)} of {len(texts)} texts have no vector in embedding cache {self.path} "
                f"(model {self.model_name}), e.g. {missing[0][:80]!r}: rerun the embed_memories rule",
                missing,
            )
        rows = np.fromiter((self._row[k] for k in keys), dtype=np.int64, count=len(keys))
        self._consolidate()
        return np.ascontiguousarray(self._vectors[rows], dtype=np.float32)

    # ------------------------------------------------------------------ building

    def missing(self, texts: Iterable[str]) -> list[str]:
        """Distinct texts without a vector, in first-seen order."""
        seen: set[str] = set()
        out = []
        for text in texts:
            key = sha256_text(text)
            if key not in self._row and key not in seen:
                seen.add(key)
                out.append(text)
        return out

    def ensure(
        self, texts: Sequence[str], *, batch_size: int | None = None, checkpoint_every: int | None = None
    ) -> np.ndarray:
        """Embed the texts that are not cached yet, batch by batch, then return vectors for all ``texts``.

        ``checkpoint_every`` (a number of texts) saves the cache along the way, each save atomic (see
        :meth:`save`), so a long build that is interrupted, even killed, resumes after the last save and
        loses at most that many texts; otherwise call :meth:`save` when done.
        """
        todo = self.missing(texts)
        if todo:
            if self.embedder is None:
                raise MissingEmbeddings(
                    f"{len(todo)} texts are not in embedding cache {self.path} and no embedder was given",
                    todo,
                )
            batch_size = batch_size or self.embedder.batch_size
            logger.info("embedding %d new texts with %s (batch size %d)", len(todo), self.model_name, batch_size)
            since_checkpoint = 0
            # disable=None: a bar on a terminal, nothing in Snakemake log files; the summary is logged.
            with tqdm(total=len(todo), unit="text", desc=f"embed {self.model_name}", disable=None) as bar:
                for start in range(0, len(todo), batch_size):
                    batch = todo[start : start + batch_size]
                    self.add(batch, self.embedder.encode(batch, batch_size=batch_size))
                    bar.update(len(batch))
                    since_checkpoint += len(batch)
                    if checkpoint_every and since_checkpoint >= checkpoint_every:
                        self.save()
                        since_checkpoint = 0
                        # The bar is off in log files: this line is the progress a Snakemake log shows.
                        logger.info(
                            "embedded %d of %d new texts, saved to %s",
                            start + len(batch),
                            len(todo),
                            self.path,
                        )
        return self.get(texts)

    def add(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Store vectors computed elsewhere (another cache, a batch embedded by the caller)."""
        if vectors.shape != (len(texts), self.dim):
            raise EmbeddingCacheError(
                f"embedder returned shape {vectors.shape} for {len(texts)} texts, expected dim {self.dim}"
            )
        for text in texts:
            key = sha256_text(text)
            self._row[key] = len(self._keys)
            self._keys.append(key)
        self._added.append(vectors.astype(np.float32, copy=False))
        self._dirty = True

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the cache directory so that no reader ever sees it half-written.

        The files are written into a temporary directory beside the target, which then replaces it by
        two renames (for an instant between them the target is absent, never partial). On any error the
        previous directory is left as it was and the temporary one is removed.
        """
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("this cache has no path: pass one to save()")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            np.save(tmp / VECTORS_FILE, np.ascontiguousarray(self.vectors, dtype=np.float32))
            (tmp / KEYS_FILE).write_text("".join(k + "\n" for k in self._keys), encoding="ascii")
            # The manifest goes last: a directory with a manifest is complete.
            write_json_atomic(
                tmp / MANIFEST_FILE,
                {
                    "format_version": FORMAT_VERSION,
                    "model_name": self.model_name,
                    "dim": self.dim,
                    "count": len(self._keys),
                    "dtype": "float32",
                    "normalized": True,
                    "key": "sha256 of the UTF-8 text, hex",
                    "created_at": self.created_at,
                    "updated_at": _now(),
                },
            )
            share_like_open(tmp)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.path = target
        self._dirty = False
        logger.info("saved embedding cache %s (%d vectors)", target, len(self._keys))
        return target

    @property
    def dirty(self) -> bool:
        """True when vectors were added since the last load or save."""
        return self._dirty


def _replace_dir(new: Path, target: Path) -> None:
    """Move directory ``new`` onto ``target``; a rename cannot replace a non-empty directory, so the old
    one is first renamed aside and removed afterwards."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rename(target, old / target.name)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old / target.name, target)
        raise
    finally:
        # Open memory maps of the old vectors stay valid: Linux keeps unlinked files alive while mapped.
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)


def build_embedding_cache(
    memories_parquet: str | os.PathLike,
    cache_dir: str | os.PathLike,
    model_name: str,
    batch_size: int = 64,
    *,
    summary_path: str | os.PathLike | None = None,
    embedder: Embedder | None = None,
    pool_dir: str | os.PathLike | None = None,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
) -> dict[str, Any]:
    """Make sure every ``content`` of the memories table has a vector in ``cache_dir`` (rule ``embed_memories``).

    Returns, and writes to ``summary_path`` when given, ``{"model_name", "dim", "total", "distinct",
    "new", "reused", "cache_size", "seconds", "cache_dir"}``; ``total`` counts rows, ``new`` + ``reused``
    = ``distinct`` texts.

    ``pool_dir`` is a second cache that outlives this output: Snakemake deletes a ``directory()`` output
    before it reruns the rule (and after a failed run), so vectors are first taken from the pool, and
    new ones are embedded into it, which is saved every ``checkpoint_every`` texts: a run that is
    interrupted, even killed, is continued by the next one without embedding again what was saved.
    Without a pool the output cache itself is saved along the way.
    """
    start = time.perf_counter()
    contents = (
        read_parquet_columns(memories_parquet, {"content": "string"}, "a memories table").column("content").to_pylist()
    )
    if any(c is None for c in contents):
        raise ValueError(f"{memories_parquet}: column 'content' has nulls")
    embedder = embedder or Embedder(model_name, batch_size=batch_size)
    if embedder.model_name != canonical_model_name(model_name):
        raise ValueError(f"embedder {embedder.model_name!r} given for model_name {model_name!r}")
    cache = EmbeddingCache.open(cache_dir, embedder)
    distinct = len({sha256_text(c) for c in contents})
    if pool_dir is None:
        new = len(cache.missing(contents))
        cache.ensure(contents, batch_size=batch_size, checkpoint_every=checkpoint_every)
    else:
        pool = EmbeddingCache.open(pool_dir, embedder)
        lacking = cache.missing(contents)
        new = len(pool.missing(lacking))
        vectors = pool.ensure(lacking, batch_size=batch_size, checkpoint_every=checkpoint_every)
        if pool.dirty:
            pool.save()
        if lacking:
            cache.add(lacking, vectors)
    if cache.dirty or not (Path(cache_dir) / MANIFEST_FILE).is_file():
        cache.save()
    summary = {
        "model_name": cache.model_name,
        "dim": cache.dim,
        "total": len(contents),
        "distinct": distinct,
        "new": new,
        "reused": distinct - new,
        "cache_size": len(cache),
        "seconds": round(time.perf_counter() - start, 3),
        "cache_dir": str(cache_dir),
    }
    logger.info(
        "embedding cache %s: %d rows, %d distinct texts, %d new, %d reused, %.1f s",
        cache_dir,
        summary["total"],
        distinct,
        new,
        summary["reused"],
        summary["seconds"],
    )
    if summary_path is not None:
        write_json_atomic(summary_path, summary)
    return summary
