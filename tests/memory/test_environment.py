"""The run's memory environment: one typed record, written once and read by tools and rewards anywhere."""

import json
import os

import pytest

from memupdate.memory.environment import FILE_NAME, MemoryEnvironment, MemoryEnvironmentError


def test_written_with_absolute_paths_and_read_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = MemoryEnvironment(memories="data/memories.parquet", embeddings="emb", max_content_chars=120)
    path = env.write("run")
    assert path == tmp_path / "run" / FILE_NAME and path.is_absolute()
    # A worker in another working directory reads the same files.
    monkeypatch.chdir("/")
    read = MemoryEnvironment.read(path)
    assert read.memories == str(tmp_path / "data/memories.parquet") and read.embeddings == str(tmp_path / "emb")
    assert (read.embedding_model, read.max_content_chars) == ("all-MiniLM-L6-v2", 120)
    assert not [p for p in path.parent.iterdir() if p != path]  # atomic: no temporary file left


def test_a_rewritten_file_is_read_again(tmp_path):
    path = MemoryEnvironment(memories="m", embeddings="e").write(tmp_path)
    assert MemoryEnvironment.read(path).max_content_chars == 300
    MemoryEnvironment(memories="m", embeddings="e", max_content_chars=50).write(tmp_path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a rewrite within the clock's resolution
    assert MemoryEnvironment.read(path).max_content_chars == 50


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"memories": "m", "embeddings": "e", "top_k": 5}, r"unknown fields \['top_k'\]"),
        ({"memories": "m"}, r"missing fields \['embeddings'\]"),
        ({"memories": "m", "embeddings": "", "max_content_chars": 9}, "embeddings must be a non-empty"),
        ({"memories": "m", "embeddings": "e", "max_content_chars": "9"}, "max_content_chars must be a positive"),
        (["m", "e"], "expected a JSON object"),
    ],
)
def test_a_bad_file_names_itself_and_the_field(tmp_path, record, message):
    path = tmp_path / FILE_NAME
    path.write_text(json.dumps(record))
    with pytest.raises(MemoryEnvironmentError, match=f"^{path}: .*{message}"):
        MemoryEnvironment.read(path)


def test_a_missing_or_torn_file_says_what_it_is(tmp_path):
    with pytest.raises(MemoryEnvironmentError, match="no memory environment here"):
        MemoryEnvironment.read(tmp_path / FILE_NAME)
    (tmp_path / FILE_NAME).write_text('{"memories": ')
    with pytest.raises(MemoryEnvironmentError, match="cannot read the memory environment"):
        MemoryEnvironment.read(tmp_path / FILE_NAME)


def test_importing_it_loads_no_heavy_module():
    """The CLI and the Snakefile read its defaults; the store, the cache and the embedder stay unloaded."""
    import subprocess
    import sys

    code = "import sys, memupdate.memory.environment; print(sorted({'numpy', 'pyarrow', 'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
