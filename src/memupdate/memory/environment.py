"""A run's memory environment: where its memory tools and reward find the store, and how they may edit it.

One typed record, written once per run as ``<run>/memory_environment.json`` next to the resolved config
and read back wherever a tool or a reward manager is built: in process (evaluation, the cold start,
benchmarks) or in a Ray worker on another node (verl's trainer; the run folder is on the shared file
system). Tools get the file's path through their config (:func:`memupdate.tools.config.write_tool_config`),
reward managers through their settings (``memory_environment``); nothing travels through the process
environment.

>>> env = MemoryEnvironment(memories="results/data/locomo/memories.parquet",
...                         embeddings="results/embeddings/all-MiniLM-L6-v2/memories")
>>> env.embedding_model, env.max_content_chars
('all-MiniLM-L6-v2', 300)

This module imports nothing heavy (the CLI and the Snakefile read its defaults); a process's store manager
for an environment is :func:`memupdate.memory.manager.manager_for`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memupdate.names import MEMORY_TOOLS
from memupdate.settings import DEFAULT_EMBEDDING_MODEL, DEFAULT_MAX_CONTENT_CHARS
from memupdate.utils.io import write_json_atomic

#: The file a run writes into its folder.
FILE_NAME = "memory_environment.json"


class MemoryEnvironmentError(ValueError):
    """A memory-environment file is missing, unreadable or has a bad field; the message names both."""


@dataclass(frozen=True, kw_only=True)
class MemoryEnvironment:
    """The memories table, its embedding cache and model, the cap on memory text the tools write, and which
    tools the policy is given, with full or compact schemas."""

    #: The base store: ``results/data/locomo/memories.parquet``.
    memories: str
    #: The embedding cache of that table (``memupdate.memory.cache``), built with ``embedding_model``.
    embeddings: str
    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS
    #: The memory tools the policy sees (names of memupdate.names.MEMORY_TOOLS; the run's tools.yaml lists
    #: only these) and whether their schemas are the compact ones (memupdate.tools.memory_tools).
    tools: tuple[str, ...] = MEMORY_TOOLS
    compact_schemas: bool = False
    #: Whether each search result names the query's content words its text holds.
    search_matches: bool = False

    def __post_init__(self) -> None:
        for name in ("memories", "embeddings", "embedding_model"):
            value = getattr(self, name)
            if not isinstance(value, str | os.PathLike) or not str(value):
                raise MemoryEnvironmentError(
                    f"memory environment: {name} must be a non-empty path or name, got {value!r}"
                )
            object.__setattr__(self, name, str(value))
        cap = self.max_content_chars
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise MemoryEnvironmentError(
                f"memory environment: max_content_chars must be a positive integer, got {cap!r}"
            )
        tools = self.tools
        if isinstance(tools, str) or not isinstance(tools, list | tuple) or not tools:
            raise MemoryEnvironmentError(f"memory environment: tools must be a non-empty list of names, got {tools!r}")
        unknown = [t for t in tools if t not in MEMORY_TOOLS]
        if unknown or len(set(tools)) != len(tools):
            raise MemoryEnvironmentError(
                f"memory environment: tools {list(tools)} repeat a name or name unknown ones {unknown}; "
                f"known: {list(MEMORY_TOOLS)}"
            )
        object.__setattr__(self, "tools", tuple(tools))
        for name in ("compact_schemas", "search_matches"):
            if not isinstance(getattr(self, name), bool):
                raise MemoryEnvironmentError(
                    f"memory environment: {name} must be true or false, got {getattr(self, name)!r}"
                )

    def write(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/memory_environment.json`` (atomically, paths made absolute so a worker in
        another working directory reads the same files) and return its absolute path."""
        path = Path(directory).resolve() / FILE_NAME
        record = dataclasses.asdict(self)
        record["memories"], record["embeddings"] = (os.path.abspath(record[k]) for k in ("memories", "embeddings"))
        write_json_atomic(path, record)
        return path

    @classmethod
    def from_dict(cls, record: Any, source: str = "memory environment") -> MemoryEnvironment:
        """Build from a mapping, naming ``source`` and the field in every error."""
        if not isinstance(record, dict):
            raise MemoryEnvironmentError(f"{source}: expected a JSON object, got {type(record).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = (
            sorted(set(record) - fields),
            sorted(f for f in ("memories", "embeddings") if f not in record),
        )
        if unknown or missing:
            raise MemoryEnvironmentError(
                f"{source}: unknown fields {unknown}, missing fields {missing}; fields: {sorted(fields)}"
            )
        try:
            return cls(**record)
        except MemoryEnvironmentError as err:
            raise MemoryEnvironmentError(f"{source}: {err}") from None

    @classmethod
    def read(cls, path: str | os.PathLike) -> MemoryEnvironment:
        """The environment written to ``path`` by :meth:`write`; a clear error if it is missing or bad."""
        path = os.path.abspath(path)
        try:
            version = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            raise MemoryEnvironmentError(
                f"{path}: no memory environment here; a run writes it into its folder before building tools or rewards"
            ) from None
        return _read(path, version)


@functools.lru_cache(maxsize=16)
def _read(path: str, version: int) -> MemoryEnvironment:
    # Cached by modification time: verl builds every tool and reward manager of a worker from the same
    # file, and a rewritten file (a rerun in one process) is read again.
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise MemoryEnvironmentError(f"{path}: cannot read the memory environment: {err}") from None
    return MemoryEnvironment.from_dict(record, path)
