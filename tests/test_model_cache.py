"""The default model's GGUF is converted once per file content (engine/model/loader.py):
a fresh clone's own virtualenv installs the same file with a new mtime, and keying the
conversion by mtime made its first start convert again (~25 s of a 58 s start)."""
import os
import shutil

from engine.model import loader


def test_the_same_bytes_anywhere_share_one_key_and_other_bytes_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path / "cache"))
    first = tmp_path / "venv-a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(os.urandom(3 << 20))
    second = tmp_path / "venv-b" / "model.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)  # another install of the same file: a new mtime
    os.utime(second, ns=(1, 1))
    assert first.stat().st_mtime_ns != second.stat().st_mtime_ns
    digest = loader.content_digest(first)
    assert loader.content_digest(second) == digest
    other = tmp_path / "venv-c" / "model.gguf"
    other.parent.mkdir()
    data = first.read_bytes()
    other.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # b"x" was the last byte 1 in 256
    assert loader.content_digest(other) != digest
    # memoised by (path, size, mtime): the next start does not read the file again
    memo = list((tmp_path / "cache" / "models" / ".digests").iterdir())
    assert len(memo) == 3
    first.write_bytes(b"")  # a changed file (size, mtime) is read again
    assert loader.content_digest(first) != digest
