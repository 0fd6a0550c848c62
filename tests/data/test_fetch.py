import pytest

from memupdate.data.fetch import ChecksumMismatch, fetch_file
from memupdate.utils.io import sha256_file


@pytest.fixture()
def published(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    path = mirror / "data.json"
    path.write_text('{"answer": 42}')
    return path, sha256_file(path)


def test_mirror_copy_is_used_when_its_hash_matches(published, tmp_path):
    path, digest = published
    dest = tmp_path / "out" / "copy.json"
    info = fetch_file("https://example.invalid/x/data.json", dest, sha256=digest, mirrors=[path.parent])
    assert info == {"origin": str(path), "sha256": digest}
    assert dest.read_bytes() == path.read_bytes()


def test_mirror_with_wrong_content_is_skipped_then_local_source_used(published, tmp_path):
    path, digest = published
    bad_mirror = tmp_path / "bad"
    bad_mirror.mkdir()
    (bad_mirror / "data.json").write_text("tampered")
    dest = tmp_path / "copy.json"
    info = fetch_file(str(path), dest, sha256=digest, mirrors=[bad_mirror])
    assert info["origin"] == str(path) and dest.read_bytes() == path.read_bytes()


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(published, tmp_path):
    path, digest = published
    dest = tmp_path / "copy.json"
    with pytest.raises(ChecksumMismatch, match=f"sha256 is {digest}, expected {'0' * 64}"):
        fetch_file(f"file://{path}", dest, sha256="0" * 64)
    assert not dest.exists()
    assert list(tmp_path.glob(".copy.json*")) == []


def test_missing_local_file_and_bad_scheme(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.json: data file not found"):
        fetch_file(str(tmp_path / "nowhere.json"), tmp_path / "x", sha256=None)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        fetch_file("ftp://host/file.json", tmp_path / "x", sha256=None)


def test_real_locomo_checksum(locomo_path, tmp_path):
    digest = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"
    info = fetch_file("https://example.invalid/locomo10.json", tmp_path / "l.json", sha256=digest,
                      mirrors=[locomo_path.parent])
    assert info["sha256"] == digest
