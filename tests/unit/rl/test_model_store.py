"""`rl.model_store`: the base model published once to the run's storage (content-addressed, marker last) and loaded
into an empty node cache from a real S3 server on loopback, byte for byte; torn or damaged copies are never trusted."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import fsspec
import pytest

from dataplane.errors import IntegrityError
from rl import checkpoint, model_store
from rl.model_store import is_published, manifest, materialize, publish


@pytest.fixture
def model(tmp_path) -> Path:
    """A small model-like folder: two weight shards, a config, a nested tokenizer file; plus what is not published."""
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 300)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * 12345)
    (folder / "sub" / "tokenizer.json").write_text('{"v": 1}')
    (folder / ".cache").mkdir()  # a hub download's metadata: not part of the model
    (folder / ".cache" / "x.lock").write_text("")
    (folder / checkpoint.TRAINER_STATE).mkdir()  # a checkpoint's optimizer state: not part of the base model
    (folder / checkpoint.TRAINER_STATE / "optimizer.safetensors").write_bytes(b"opt")
    return folder


PUBLISHED = [
    "config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "sub/tokenizer.json",
]


def _files(folder: str | Path) -> dict[str, bytes]:
    root = Path(folder)
    skip = (checkpoint.COMPLETE, model_store.CACHE_MANIFEST)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def _fs(url: str, so: dict):
    fs, path = fsspec.core.url_to_fs(url, use_listings_cache=False, **so)
    return fs, path.rstrip("/")


def test_the_manifest_lists_the_model_files_only_and_its_hash_names_the_folder(model):
    raw = manifest(model)
    doc = json.loads(raw)
    assert sorted(doc["files"]) == PUBLISHED
    blob = (model / "model-00002-of-00002.safetensors").read_bytes()
    assert doc["files"]["model-00002-of-00002.safetensors"] == {
        "size": 12345,
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    assert model_store.digest(raw) == hashlib.sha256(raw).hexdigest()
    assert manifest(model) == raw  # canonical: the same folder, the same bytes
    (model / "config.json").write_text('{"model_type": "llama", "x": 1}')
    assert manifest(model) != raw


def test_publish_is_content_addressed_and_a_second_publish_uploads_nothing(model, store, monkeypatch):
    root, so = store
    url = publish(model, root, so)
    digest = model_store.digest(manifest(model))
    assert url == f"{root}/models/{digest}"
    assert is_published(url, so)
    fs, path = _fs(url, so)
    for rel in PUBLISHED:
        assert fs.cat_file(f"{path}/{rel}") == (model / rel).read_bytes(), rel
    assert not fs.exists(f"{path}/.cache") and not fs.exists(f"{path}/{checkpoint.TRAINER_STATE}")
    assert checkpoint.verify(url, so)["files"].keys() == set(
        PUBLISHED
    )  # a weights-only checkpoint in rl.checkpoint's format

    def no_upload(*args, **kwargs):
        raise AssertionError("a second publish of the same model must upload nothing")

    monkeypatch.setattr(model_store, "_upload", no_upload)
    monkeypatch.setattr(model_store, "_publish_local", no_upload)
    copy = model.parent / "elsewhere"  # the same bytes in another folder (another run, another machine)
    shutil.copytree(model, copy)
    assert publish(copy, root, so) == url


def test_a_torn_publish_is_not_trusted_and_the_next_publish_completes_it(model, s3_server, tmp_path, monkeypatch):
    root, so = f"s3://grpoflow/torn-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    real_put = None

    def dies_on_the_second_shard(self, lpath, rpath, *args, **kwargs):
        if rpath.endswith("model-00002-of-00002.safetensors"):
            raise PermissionError("the pod was killed")  # permanent: not retried
        return real_put(self, lpath, rpath, *args, **kwargs)

    import s3fs

    real_put = s3fs.S3FileSystem.put_file
    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", dies_on_the_second_shard)
    with pytest.raises(PermissionError):
        publish(model, root, so)
    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", real_put)
    url = f"{root}/models/{model_store.digest(manifest(model))}"
    fs, path = _fs(url, so)
    assert fs.exists(f"{path}/config.json") and not is_published(url, so)  # some files, no marker
    with pytest.raises(IntegrityError, match=r"is not complete: it has no _COMPLETE marker"):
        materialize(url, so, cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / url.rsplit("/", 1)[-1]).exists()

    assert publish(model, root, so) == url
    loaded = _files(materialize(url, so, cache=tmp_path / "cache"))
    assert loaded == {rel: (model / rel).read_bytes() for rel in PUBLISHED}


def test_an_empty_node_cache_loads_the_published_model_from_s3_byte_for_byte(model, s3_server, tmp_path):
    root, so = f"s3://grpoflow/load-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    url = publish(model, root, so)
    cache = tmp_path / "node-cache"
    assert not cache.exists()
    folder = materialize(url, so, cache=cache)
    assert Path(folder) == cache / url.rsplit("/", 1)[-1]
    loaded = _files(folder)
    assert sorted(loaded) == PUBLISHED and all(loaded[rel] == (model / rel).read_bytes() for rel in PUBLISHED)
    assert (Path(folder) / model_store.CACHE_MANIFEST).read_bytes() == manifest(model)
    # a plain model folder to loaders: checked whole once, when downloaded, and not hashed again at every load
    assert not (Path(folder) / checkpoint.COMPLETE).exists()
    assert checkpoint.local_copy(folder) == folder
    assert [p.name for p in cache.iterdir()] == [Path(folder).name]  # no download folder left behind
    # the second load is the node cache's: it does not touch storage (the endpoint here refuses every connection)
    assert materialize(url, {"endpoint_url": "http://127.0.0.1:9"}, cache=cache) == folder


def test_a_download_that_fails_its_manifest_leaves_nothing_in_the_cache(model, s3_server, tmp_path):
    root, so = f"s3://grpoflow/bad-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    url = publish(model, root, so)
    fs, path = _fs(url, so)
    blob = bytearray((model / "model-00002-of-00002.safetensors").read_bytes())
    blob[100] ^= 1  # same size, other bytes
    fs.pipe_file(f"{path}/model-00002-of-00002.safetensors", bytes(blob))
    with pytest.raises(IntegrityError, match=r"model-00002-of-00002.safetensors is corrupt"):
        materialize(url, so, cache=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_marker_that_does_not_hash_to_its_folder_name_is_refused(model, s3_server, tmp_path):
    root, so = f"s3://grpoflow/name-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    url = publish(model, root, so)
    fs, path = _fs(url, so)
    wrong = f"{root}/models/{'0' * 64}"
    fs.copy(f"{path}/{checkpoint.COMPLETE}", f"{_fs(wrong, so)[1]}/{checkpoint.COMPLETE}")
    with pytest.raises(IntegrityError, match=r"hashes to [0-9a-f]{64}, not to the digest"):
        materialize(wrong, so, cache=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"not a published model"):
        materialize(f"{root}/models/some-model", so, cache=tmp_path / "cache")


def test_a_damaged_cached_copy_is_downloaded_again(model, s3_server, tmp_path):
    root, so = f"s3://grpoflow/damaged-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    url = publish(model, root, so)
    folder = Path(materialize(url, so, cache=tmp_path / "cache"))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"truncated")
    assert materialize(url, so, cache=tmp_path / "cache") == str(folder)
    assert (
        _files(folder)["model-00001-of-00002.safetensors"] == (model / "model-00001-of-00002.safetensors").read_bytes()
    )


def test_a_folder_in_the_cache_that_is_not_a_cached_copy_is_replaced(model, s3_server, tmp_path):
    root, so = f"s3://grpoflow/stale-{tmp_path.name}", {"endpoint_url": s3_server}
    fsspec.filesystem("s3").clear_instance_cache()
    url = publish(model, root, so)
    stale = tmp_path / "cache" / url.rsplit("/", 1)[-1]
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no manifest: not something materialize left there
    assert materialize(url, so, cache=tmp_path / "cache") == str(stale)
    assert _files(stale) == {rel: (model / rel).read_bytes() for rel in PUBLISHED}


def test_concurrent_publishers_and_loaders_agree(model, store, tmp_path):
    root, so = store
    urls, folders, errors = [], [], []

    def run(target: list, fn) -> None:
        try:
            target.append(fn())
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(urls, lambda: publish(model, root, so))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(urls)) == 1
    url = urls[0]
    if not model_store.is_remote(url):
        assert materialize(url, so) == url  # a local or shared disk: loaded where it is
        assert [p.name for p in Path(url).parent.iterdir()] == [Path(url).name]  # no staging folder left
        return
    cache = tmp_path / "cache"
    threads = [
        threading.Thread(target=run, args=(folders, lambda: materialize(url, so, cache=cache))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(folders)) == 1
    assert sorted(_files(folders[0])) == PUBLISHED and [p.name for p in cache.iterdir()] == [Path(folders[0]).name]


def test_local_folders_and_hub_ids_pass_through_unchanged(tmp_path):
    assert materialize(str(tmp_path)) == str(tmp_path)
    assert materialize(f"file://{tmp_path}") == str(tmp_path)
    assert materialize("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not model_store.is_remote("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert model_store.is_remote("s3://bucket/models/x") and model_store.is_remote("memory://models/x")


def test_the_cache_lives_under_the_grpoflow_cache_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv(model_store.CACHE_ENV, raising=False)
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "g"))
    assert model_store.cache_root() == tmp_path / "g" / "published"
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "node"))
    assert model_store.cache_root() == tmp_path / "node"


def test_publishing_an_empty_or_missing_folder_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not a folder"):
        publish(tmp_path / "nope", str(tmp_path / "dp"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no files to publish"):
        publish(tmp_path / "empty", str(tmp_path / "dp"))
