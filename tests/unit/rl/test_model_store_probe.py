"""`rl.model_store` against a damaged store or node cache: same-size corruption in a cached copy is found (hashed
once per process per file) and downloaded again; a file lost from the store is re-published; a stray folder at a
digest path is replaced; a cache path that is a file fails with a message naming it and the fix."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from dataplane.errors import IntegrityError
from rl import checkpoint, manifest, model_store
from rl.model_store import materialize, publish
from tests.unit.rl.test_model_store import PUBLISHED, _files, _fs, model  # noqa: F401 (model: a fixture)

SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture
def published(model, s3_server, tmp_path):  # noqa: F811 (the imported fixture)
    """``(url, storage_options, cache)``: ``model`` published to loopback S3, and an empty node cache."""
    root, so = f"s3://grpoflow/probe-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    return publish(model, root, so), so, tmp_path / "cache"


@pytest.fixture
def hashes(monkeypatch):
    """The files :func:`rl.manifest.file_digest` hashes from now on (their names), in a process that has hashed
    nothing yet."""
    seen: list[str] = []
    real = manifest.file_digest

    def counting(path: Path) -> str:
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(manifest, "file_digest", counting)
    monkeypatch.setattr(manifest, "_VERIFIED", {})
    monkeypatch.setattr(model_store, "_TRUSTED", {}, raising=False)
    return seen


def _new_process(monkeypatch) -> None:
    monkeypatch.setattr(manifest, "_VERIFIED", {})
    monkeypatch.setattr(model_store, "_TRUSTED", {}, raising=False)


def test_same_size_corruption_in_the_node_cache_is_found_and_downloaded_again(model, published, capsys):  # noqa: F811
    url, so, cache = published
    folder = Path(materialize(url, so, cache=cache))
    blob = bytearray((folder / SHARD).read_bytes())
    for i in range(16):
        blob[1000 * i + 7] ^= 1 << (i % 8)  # 16 bit flips, same size
    (folder / SHARD).write_bytes(bytes(blob))
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config.replace("llama", "mamba"))  # same length, another model
    assert (folder / "config.json").stat().st_size == len(config)

    assert materialize(url, so, cache=cache) == str(folder)
    assert _files(folder) == {rel: (model / rel).read_bytes() for rel in PUBLISHED}
    err = capsys.readouterr().err
    assert f"the node cache's copy {folder} is damaged or not a cached model" in err
    assert "is corrupt" in err and ("config.json" in err or SHARD in err)
    assert [p.name for p in cache.iterdir()] == [folder.name]  # the damaged copy is gone, no staging folder left


def test_the_node_cache_hashes_each_file_once_per_process(published, hashes, monkeypatch):
    url, so, cache = published
    folder = materialize(url, so, cache=cache)
    assert sorted(hashes) == sorted(Path(rel).name for rel in PUBLISHED)  # the download, checked once
    hashes.clear()
    assert materialize(url, so, cache=cache) == folder  # the same process: the files are unchanged, nothing hashed
    assert hashes == []
    _new_process(monkeypatch)
    assert materialize(url, so, cache=cache) == folder  # another pod on the node: it hashes every file once
    assert sorted(hashes) == sorted(Path(rel).name for rel in PUBLISHED)
    hashes.clear()
    assert materialize(url, so, cache=cache) == folder
    assert hashes == []


def test_a_cache_path_that_is_a_file_fails_naming_it_and_the_fix(published):
    url, so, cache = published
    cache.write_text("not a folder")
    with pytest.raises(FileExistsError, match=r"node model cache .*cache is a file, not a folder") as err:
        materialize(url, so, cache=cache)
    assert model_store.CACHE_ENV in str(err.value) and f"remove {cache}" in str(err.value)


def test_a_storage_root_whose_models_path_is_a_file_fails_naming_it(model, tmp_path):  # noqa: F811
    root = tmp_path / "dp"
    root.mkdir()
    (root / model_store.MODELS).write_text("not a folder")
    with pytest.raises(FileExistsError, match=r"is a file, not a folder") as err:
        publish(model, str(root))
    assert str(root / model_store.MODELS) in str(err.value)


def test_a_file_deleted_from_the_store_is_published_again(model, store):  # noqa: F811
    root, so = store
    url = publish(model, root, so)
    fs, path = _fs(url, so)
    fs.rm_file(f"{path}/{SHARD}")
    fs.pipe_file(f"{path}/sub/tokenizer.json", b"{}")  # truncated
    assert publish(model, root, so) == url
    for rel in PUBLISHED:
        assert fs.cat_file(f"{path}/{rel}") == (model / rel).read_bytes(), rel
    assert checkpoint.verify(url, so)["files"].keys() == set(PUBLISHED)


def test_a_download_of_a_file_lost_from_the_store_names_its_path_and_the_fix(published):
    url, so, cache = published
    fs, path = _fs(url, so)
    fs.rm_file(f"{path}/{SHARD}")
    with pytest.raises(IntegrityError, match=r"is missing from the store") as err:
        materialize(url, so, cache=cache)
    assert f"{url}/{SHARD}" in str(err.value) and "publish the model folder again" in str(err.value)
    assert list(cache.iterdir()) == []


def test_a_stray_folder_at_the_published_path_is_replaced(model, tmp_path, capsys):  # noqa: F811
    root = str(tmp_path / "dp")
    target = Path(model_store.models_dir(root)) / model_store.digest(model_store.manifest(model))
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: a torn copy, not a publish
    (target / "stray.bin").write_bytes(b"x")
    assert publish(model, root) == str(target)
    assert _files(target) == {rel: (model / rel).read_bytes() for rel in PUBLISHED}
    assert (target / checkpoint.COMPLETE).read_bytes() == model_store.manifest(model)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # the stray folder is gone
    assert f"{target} holds no {checkpoint.COMPLETE} marker" in capsys.readouterr().err


def test_a_stray_file_at_the_node_cache_path_is_replaced(model, published):  # noqa: F811
    url, so, cache = published
    cache.mkdir()
    (cache / url.rsplit("/", 1)[-1]).write_text("stray")
    folder = materialize(url, so, cache=cache)
    assert _files(folder) == {rel: (model / rel).read_bytes() for rel in PUBLISHED}
    assert [p.name for p in cache.iterdir()] == [Path(folder).name]
