import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from memupdate.data.fetch import ChecksumMismatch, fetch_file, verify_copy
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


def test_without_a_sha256_a_mirrors_copy_is_never_taken(published, tmp_path):
    """A truncated copy in a mirror folder cannot be told from a whole one without the hash: the source is used."""
    path, _ = published
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "data.json").write_text('{"answ')
    info = fetch_file(str(path), tmp_path / "copy.json", sha256=None, mirrors=[truncated])
    assert info["origin"] == str(path) and (tmp_path / "copy.json").read_bytes() == path.read_bytes()


def test_a_copy_changed_after_the_fetch_is_refused_where_it_is_read(published):
    path, digest = published
    verify_copy(path, digest)
    path.write_text('{"answer": 43}')
    with pytest.raises(ChecksumMismatch, match=r"data.json: sha256 is [0-9a-f]{64}, not the .* the copy changed"):
        verify_copy(path, digest)


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(published, tmp_path):
    path, digest = published
    dest = tmp_path / "copy.json"
    with pytest.raises(ChecksumMismatch, match=f"sha256 is {digest}, expected {'0' * 64}"):
        fetch_file(f"file://{path}", dest, sha256="0" * 64)
    assert not dest.exists()
    assert list(tmp_path.glob(".copy.json*")) == []


def test_missing_local_file_and_bad_scheme(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere.json \(data file not found\)"):
        fetch_file(str(tmp_path / "nowhere.json"), tmp_path / "x", sha256=None)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        fetch_file("ftp://host/file.json", tmp_path / "x", sha256=None)


def test_real_locomo_checksum(locomo_path, tmp_path):
    digest = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"
    info = fetch_file(
        "https://example.invalid/locomo10.json", tmp_path / "l.json", sha256=digest, mirrors=[locomo_path.parent]
    )
    assert info["sha256"] == digest


BODY = bytes(range(256)) * 4096  # 1 MiB: more than one read of the downloader


class _Handler(BaseHTTPRequestHandler):
    """``/whole`` sends BODY; ``/half`` announces BODY's length, sends half and closes, like a dropped link."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY if self.path.endswith("/whole") else BODY[: len(BODY) // 2])
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def unreachable_url():
    # A port that was just free: nothing listens there, so the connection is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/data.json"


def test_download_without_hash_is_complete_and_atomic(server, tmp_path):
    dest = tmp_path / "data.bin"
    info = fetch_file(f"{server}/whole", dest, sha256=None)
    assert dest.read_bytes() == BODY and info["origin"] == f"{server}/whole"


def test_download_cut_short_without_hash_fails_and_leaves_nothing(server, tmp_path):
    dest = tmp_path / "data.bin"
    dest.write_bytes(b"previous copy")
    with pytest.raises(
        ConnectionError,
        match=rf"{server}/half \(download failed: received {len(BODY) // 2} of the "
        rf"{len(BODY)} bytes announced \(Content-Length\)\)",
    ):
        fetch_file(f"{server}/half", dest, sha256=None)
    # The earlier file is untouched and no partial temporary file is left beside it.
    assert dest.read_bytes() == b"previous copy"
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]


def test_every_place_tried_is_named_with_its_reason(published, tmp_path):
    path, digest = published
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    (tampered / "data.json").write_text("tampered")
    url = unreachable_url()
    with pytest.raises(ConnectionError) as info:
        fetch_file(url, tmp_path / "copy.json", sha256=digest, mirrors=[tampered])
    message = str(info.value)
    assert message.startswith(
        f"could not get data.json (sha256 {digest}); tried: mirror {tampered / 'data.json'}: "
        f"sha256 is {sha256_file(tampered / 'data.json')}, expected {digest}; {url} "
        "(download failed: <urlopen error"
    )
    assert "Connection refused" in message
    assert "replace it, or fix the expected sha256" in message
    # The mirror is already listed: the advice must not be to add it.
    assert "add a folder" not in message


def test_a_mirror_folder_that_does_not_exist_is_reported(published, tmp_path, caplog):
    path, digest = published
    missing = tmp_path / "no-such-folder"
    with caplog.at_level(logging.WARNING, logger="memupdate.data.fetch"):
        info = fetch_file(str(path), tmp_path / "copy.json", sha256=digest, mirrors=[missing])
    assert info["origin"] == str(path)
    assert f"data mirror folder {missing} does not exist" in caplog.text


def test_a_verified_copy_survives_a_rerun_that_cannot_fetch(published, tmp_path):
    """Issue 58: Snakemake deletes fetch_data's output before it reruns (a changed filename or data.mirrors); offline,
    the fetch then found nothing and the good copy was gone. The store of verified copies by sha256 supplies it."""
    path, digest = published
    dest, store = tmp_path / "resources" / "data.json", tmp_path / "resources" / ".verified"
    fetch_file("https://example.invalid/x/data.json", dest, sha256=digest, mirrors=[path.parent], store=store)
    assert (store / digest).read_bytes() == path.read_bytes()
    dest.unlink()  # as Snakemake does before running the job again
    info = fetch_file("https://example.invalid/x/data.json", dest, sha256=digest, mirrors=[], store=store)
    assert info == {"origin": str(store / digest), "sha256": digest} and dest.read_bytes() == path.read_bytes()
    # A damaged copy in the store is dropped, not used.
    (store / digest).write_text("{}")
    dest.unlink()
    with pytest.raises(ConnectionError):
        fetch_file("https://example.invalid/x/data.json", dest, sha256=digest, mirrors=[], store=store, timeout_s=2)
    assert not (store / digest).exists() and not dest.exists()
