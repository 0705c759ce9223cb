"""The probed library features are kept on disk per set of installed libraries (hf_dist.planning.feature_store):
read back without importing them, probed again when anything installed changes or the file is not ours."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_dist.planning import feature_store
from hf_dist.planning.features import LibraryFeatures, installed_features, probe_features


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(feature_store.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_features_are_probed_once_then_read_without_importing_the_libraries(store):
    probed = probe_features()
    feature_store.store_features(probed)
    assert feature_store.load_features(LibraryFeatures) == probed
    code = ("import sys; from hf_dist.planning.features import installed_features; f = installed_features(); "
            "print(f.fsdp_version, sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(maxsplit=1) == [str(probed.fsdp_version), "[]\n"]


def test_another_installed_version_is_another_file(store, monkeypatch):
    before = feature_store.store_path()
    real = feature_store._installed
    monkeypatch.setattr(feature_store, "_installed", lambda name: ["9.9"] if name == "accelerate" else real(name))
    assert feature_store.store_path() != before and feature_store.store_path().parent == store


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", '{"fsdp_version": 2}', json.dumps({"fsdp_version": "2"}), ""],
    ids=["garbage", "list", "fields-missing", "wrong-type", "empty"],
)
def test_a_file_that_is_not_ours_is_probed_over(store, text):
    feature_store.store_path().parent.mkdir(parents=True, exist_ok=True)
    fields = {**LibraryFeatures().__dict__}
    if text == json.dumps({"fsdp_version": "2"}):
        text = json.dumps({**fields, "fsdp_version": "2"})
    feature_store.store_path().write_text(text)
    assert feature_store.load_features(LibraryFeatures) is None
    installed_features.cache_clear()
    try:
        assert installed_features() == probe_features()
        assert json.loads(feature_store.store_path().read_text()) == probe_features().__dict__
    finally:
        installed_features.cache_clear()


def test_a_store_that_cannot_be_written_costs_only_the_probe(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(feature_store.CACHE_ENV, str(blocker / "cache"))  # a folder under a file: never writable
    feature_store.store_features(LibraryFeatures())
    assert feature_store.load_features(LibraryFeatures) is None


def test_no_home_folder_costs_only_the_probe(monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for key in (feature_store.CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(feature_store.Path, "home", staticmethod(no_home))
    feature_store.store_features(LibraryFeatures())
    assert feature_store.load_features(LibraryFeatures) is None
