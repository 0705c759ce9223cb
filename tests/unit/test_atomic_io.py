"""hf_dist.atomic_io: folders appear whole or not at all; killed runs' temporaries are cleaned up."""

from __future__ import annotations

import errno

import pytest

from hf_dist.atomic_io import atomic_dir, atomic_write_json


def test_atomic_dir_replaces_only_on_success(tmp_path):
    dst = tmp_path / "out"
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_text("1")
        assert not dst.exists()
    assert (dst / "a").read_text() == "1"
    with pytest.raises(FileExistsError), atomic_dir(dst):
        pass
    with pytest.raises(KeyError), atomic_dir(dst, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
        raise KeyError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dst / "a").exists()


def test_atomic_dir_removes_stale_temporaries_and_names_a_full_disk(tmp_path):
    stale = tmp_path / ".out.tmp-999999999"  # a killed run's (no such process)
    stale.mkdir()
    full = pytest.raises(RuntimeError, match=r"disk full while writing .*out; nothing was written")
    with full, atomic_dir(tmp_path / "out"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_temp_parent(tmp_path):
    (tmp_path / "work").mkdir()
    with atomic_dir(tmp_path / "dst" / "out", temp_parent=tmp_path / "work") as tmp:
        assert tmp.parent == tmp_path / "work"
    assert (tmp_path / "dst" / "out").is_dir() and list((tmp_path / "work").iterdir()) == []


def test_atomic_write_json_sorted(tmp_path):
    path = atomic_write_json(tmp_path / "x.json", {"b": 1, "a": 2}, indent=1, sort_keys=True)
    assert path.read_text() == '{\n "a": 2,\n "b": 1\n}\n'


def test_written_files_get_the_usual_permissions_not_mkstemps_0600(tmp_path):
    import os

    from hf_dist.atomic_io import atomic_write_text

    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "config.yaml", "debug: false\n")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
