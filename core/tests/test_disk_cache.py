"""pagoda.disk_cache: where the cache lives, and files that appear complete or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.disk_cache import CACHE_ROOT_ENV, DISABLE_ENV, AtomicFile, atomic_write_text, cache_root


def test_cache_root_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(CACHE_ROOT_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "pagoda"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagoda"
    monkeypatch.setenv(CACHE_ROOT_ENV, str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    for off in ("1", "true", "YES"):
        monkeypatch.setenv(DISABLE_ENV, off)
        assert cache_root() is None
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert cache_root() == tmp_path / "mine"


def test_committed_file_replaces_the_old_one_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    out = AtomicFile(target)
    out.file.write(b"new contents")
    assert target.read_bytes() == b"old"  # readers see the old file until the rename
    out.commit()
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]
    with pytest.raises(RuntimeError, match="already committed"):
        out.commit()


def test_abandoned_or_failed_write_leaves_the_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "data.txt"
    target.write_text("old")
    out = AtomicFile(target, "w")
    out.file.write("half")
    out.abandon()
    out.abandon()
    with pytest.raises(ZeroDivisionError), AtomicFile(target, "w") as failing:
        failing.file.write("half")
        _ = 1 / 0
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]
    atomic_write_text(target, "whole")
    assert target.read_text() == "whole"


def test_atomic_file_refuses_a_mode_that_does_not_write_a_new_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        AtomicFile(tmp_path / "x", "rb")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        AtomicFile(tmp_path / "missing" / "x")
