"""Checkpoints on a local folder and on loopback S3 alike: a re-save holds exactly the files of a clean save and no
reader ever sees a torn folder as complete; the ``_COMPLETE`` manifest catches damaged files; resume falls back past
a corrupt checkpoint; stray names do not break listing; loaders load only complete checkpoints; transient storage
failures are retried."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import random
import shutil
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

import dataplane.errors
import rl.manifest
import rl.trainer_state
from dataplane.errors import IntegrityError, retry_transient
from rl import checkpoint
from rl.backends.hf.generation import HFGeneration
from rl.backends.hf.policy import HFPolicy
from rl.backends.interfaces import PolicyVersion
from rl.backends.vllm.generation import VLLMGeneration
from tests.helpers import small_config

RUN = "run-1"


# ------------------------------------------------------------------------------------------------ helpers
class _Tok:
    """All that ``save`` needs of a tokenizer (a real one adds a 3.5 MB ``tokenizer.json`` per save)."""

    def save_pretrained(self, folder: str | Path) -> None:
        Path(folder, "tokenizer_config.json").write_text('{"model_max_length": 64}')


def _model(seed: int) -> torch.nn.Module:
    """A one-layer Llama of a few kB, with weights that are a function of ``seed``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``seed`` after one AdamW update."""
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    return model, opt


def _save(url: str, so: dict, seed: int, *, trainer_state: bool = True, step: int = 1) -> str:
    """Save the model of ``seed`` (with an AdamW state after one update, when ``trainer_state``); the global RNGs
    are seeded first, so that two saves of the same seed write the same bytes."""
    model, opt = _trained(seed) if trainer_state else (_model(seed), None)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = (
        checkpoint.TrainerState(step=step, mlflow_run_id="mlflow-1", extra={"data_position": step})
        if trainer_state
        else None
    )
    return checkpoint.save(url, model=model, tokenizer=_Tok(), optimizer=opt, state=state, storage_options=so)


_URL_TO_FS = fsspec.core.url_to_fs  # the real one, for tests that wrap it


def _raw_fs(url: str, so: dict):
    fs, path = _URL_TO_FS(url, **so)
    fs.invalidate_cache()
    return fs, path.rstrip("/")


def _put(fs, path: str, data: bytes) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a local folder needs its parents; S3 ignores this
    fs.pipe_file(path, data)


def _snapshot(url: str, so: dict) -> dict[str, bytes]:
    """Every file under ``url``, by relative path."""
    fs, path = _raw_fs(url, so)
    if not fs.exists(path):
        return {}
    return {f[len(path) + 1 :]: fs.cat_file(f) for f in fs.find(path)}


def _clean_files(tmp_path: Path, seed: int, **kw) -> dict[str, bytes]:
    """The files of a clean save of ``seed`` into a fresh local folder, marker included."""
    url = str(tmp_path / f"clean-{seed}-{random.randrange(1 << 30)}")
    _save(url, {}, seed, **kw)
    return _snapshot(url, {})


def _damage(url: str, so: dict, rel: str, how: str) -> None:
    fs, path = _raw_fs(url, so)
    target = f"{path}/{rel}"
    if how == "delete":
        fs.rm(target)
        return
    data = bytearray(fs.cat_file(target))
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) - 8]
    fs.pipe_file(target, bytes(data))


def _weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- 1. a re-save is a clean save
@pytest.mark.parametrize("earlier", ["complete", "partial"])
def test_a_resave_holds_exactly_the_files_of_a_clean_save(store, tmp_path, earlier):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    if earlier == "partial":  # an attempt that died mid-upload: no marker, a torn file, a nested leftover
        fs, path = _raw_fs(url, so)
        fs.rm(f"{path}/{checkpoint.COMPLETE}")
        _damage(url, so, "model.safetensors", "truncate")
        _put(fs, f"{path}/tmpab12cd/model.safetensors", b"leftover")
    _save(url, so, seed=2)

    assert _snapshot(url, so) == _clean_files(tmp_path, seed=2)
    checkpoint.verify(url, so)
    assert _same_weights(_weights(checkpoint.local_copy(url, so, require_complete=True)), _trained(2)[0].state_dict())


def test_no_reader_sees_a_complete_looking_torn_folder_during_a_resave(store, tmp_path, monkeypatch):
    """Watch the folder after every storage operation, rename and single-file deletion of a re-save (a deletion of a
    folder removes the marker last, the worst order a filesystem may choose): whenever it has a marker, its other
    files must be exactly those of the old save or exactly those of the new one."""
    root, so = store
    url = f"{root}/{RUN}/weights/step_000003"
    _save(url, so, seed=1, trainer_state=False)
    old = {k: v for k, v in _snapshot(url, so).items() if k != checkpoint.COMPLETE}
    new = {k: v for k, v in _clean_files(tmp_path, seed=2, trainer_state=False).items() if k != checkpoint.COMPLETE}
    seen: list[str] = []

    def check(event: str) -> None:
        files = _snapshot(url, so)
        if files.pop(checkpoint.COMPLETE, None) is not None and files not in (old, new):
            seen.append(f"after {event}: marker beside {sorted(files)}")

    class Observed:
        def __init__(self, fs):
            self._fs = fs

        def __getattr__(self, name):
            attr = getattr(self._fs, name)
            if not callable(attr) or name.startswith("_") or name in ("invalidate_cache", "dircache"):
                return attr

            @functools.wraps(attr)
            def call(*args, **kwargs):
                try:
                    return attr(*args, **kwargs)
                finally:
                    check(f"fs.{name}{args[:2]}")

            return call

    def url_to_fs(u, **kw):
        fs, path = _URL_TO_FS(u, **kw)
        return Observed(fs), path

    real_rmtree, real_rename = shutil.rmtree, Path.rename

    def rmtree(path, ignore_errors=False, **kw):  # files first, the marker last, checking after each
        p = Path(path)
        if not p.exists():
            if ignore_errors:
                return
            raise FileNotFoundError(path)
        files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.name == checkpoint.COMPLETE)
        for f in files:
            f.unlink()
            check(f"deleting {f.name}")
        real_rmtree(p)

    def rename(self, target):
        out = real_rename(self, target)
        check(f"rename {Path(self).name} -> {Path(target).name}")
        return out

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(Path, "rename", rename)
    _save(url, so, seed=2, trainer_state=False)
    monkeypatch.undo()

    assert not seen, seen
    assert {k: v for k, v in _snapshot(url, so).items() if k != checkpoint.COMPLETE} == new


# --------------------------------------------------------------------------------- 2. the manifest
def test_the_marker_is_a_manifest_of_every_file(store):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    files = _snapshot(url, so)
    doc = json.loads(files.pop(checkpoint.COMPLETE))
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer_config.json",
        "trainer_state/state.json",
        "trainer_state/optimizer.safetensors",
    } <= set(files)
    assert doc["files"] == {rel: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for rel, b in files.items()}
    assert checkpoint.verify(url, so)["files"] == doc["files"]


def _cold_load(url: str, so: dict, tmp_path: Path, step: int = 1) -> None:
    """What a generation task does with a policy it does not hold: load it from its folder."""

    cfg = small_config(tmp_path, "unused-model", dataplane={"root": url.rsplit("/", 3)[0], "storage_options": so})
    HFGeneration(cfg, tokenizer=None, model_path="unused-model").refit(PolicyVersion(step=step, path=url))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_file_fails_verification_naming_it(store, tmp_path, how):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    good = hashlib.sha256(_snapshot(url, so)["model.safetensors"]).hexdigest()
    _damage(url, so, "model.safetensors", how)
    words = {"flip": "corrupt", "truncate": "corrupt", "delete": "missing"}[how]
    with pytest.raises(IntegrityError, match=rf"model\.safetensors is {words}.*{good}"):
        _cold_load(url, so, tmp_path)
    with pytest.raises(IntegrityError, match=rf"model\.safetensors is {words}.*{good}") as err:
        checkpoint.local_copy(url, so, require_complete=True)
    if how == "flip":
        bad = hashlib.sha256(_snapshot(url, so)["model.safetensors"]).hexdigest()
        assert bad in str(err.value)  # the actual digest too
    with pytest.raises(IntegrityError, match=r"model\.safetensors"):
        checkpoint.verify(url, so)


@pytest.mark.parametrize("marker", [b"", b"{not json", b'{"files": {}}'])
def test_an_empty_or_malformed_marker_gives_a_clear_error(store, tmp_path, marker):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    fs, path = _raw_fs(url, so)
    fs.pipe_file(f"{path}/{checkpoint.COMPLETE}", marker)
    want = "is empty: a checkpoint written before" if not marker else "_COMPLETE is not a"
    with pytest.raises(IntegrityError, match=want):
        _cold_load(url, so, tmp_path)
    with pytest.raises(IntegrityError, match=want):
        checkpoint.local_copy(url, so, require_complete=True)
    with pytest.raises(IntegrityError, match=want):
        checkpoint.verify(url, so)


def test_a_verified_copy_loads_the_saved_weights_and_trainer_state(store):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    folder = checkpoint.local_copy(url, so, require_complete=True)
    checkpoint.verify(folder)  # a remote copy carries its manifest
    model = _model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = checkpoint.load_trainer_state(folder, opt, None)
    assert (state.step, state.mlflow_run_id, state.extra) == (1, "mlflow-1", {"data_position": 1})
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert _same_weights(loaded.state_dict(), _trained(1)[0].state_dict())


def test_local_folder_removes_its_copy_of_a_remote_checkpoint_and_leaves_a_local_one(store):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    with checkpoint.local_folder(url, so, require_complete=True) as folder:
        assert (Path(folder) / "model.safetensors").is_file()
    remote = "://" in root
    assert Path(folder).exists() is not remote  # a copy of S3 is gone; the local folder is the checkpoint itself
    if not remote:
        assert Path(folder) == Path(url)


def _downloads(monkeypatch) -> list[str]:
    """What ``checkpoint`` downloads from here on: the ``what`` of each retried storage operation that is one."""
    got: list[str] = []
    real = checkpoint.retry_transient

    def spy(fn, *, what, **k):
        if ": download " in what:
            got.append(what.rsplit(": download ", 1)[1])  # the file, relative to the checkpoint
        return real(fn, what=what, **k)

    monkeypatch.setattr(checkpoint, "retry_transient", spy)
    return got


def test_a_weights_only_copy_leaves_the_trainer_state_behind(store, monkeypatch):
    root, so = store
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    got = _downloads(monkeypatch)
    folder = checkpoint.local_copy(url, so, require_complete=True, weights_only=True)
    assert _same_weights(_weights(folder), _trained(1)[0].state_dict())
    if "://" in root:  # a copy of S3: the optimizer moments (2x the weights) never cross the network
        assert got and not [g for g in got if checkpoint.TRAINER_STATE in g]
        assert not Path(folder, checkpoint.TRAINER_STATE).exists()
        assert set(checkpoint.verify(folder)["files"]) == {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer_config.json",
        } & set(checkpoint.verify(url, so)["files"])
        shutil.rmtree(folder)
    full = checkpoint.local_copy(url, so, require_complete=True)  # the trainer still gets everything
    model = _model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert checkpoint.load_trainer_state(full, opt, None).step == 1


def test_a_bfloat16_serving_copy_is_the_master_cast_and_what_a_bf16_loader_downloads(store, monkeypatch):
    root, so = store
    url = f"{root}/{RUN}/weights/step_000001"
    model, opt = _trained(1)
    state = checkpoint.TrainerState(step=1, mlflow_run_id="m", extra={})
    checkpoint.save(
        url, model=model, tokenizer=_Tok(), optimizer=opt, state=state, storage_options=so, serving_dtype="bfloat16"
    )
    files = checkpoint.verify(url, so)["files"]
    assert "bfloat16/model.safetensors" in files and "bfloat16/config.json" in files
    assert files["bfloat16/model.safetensors"]["size"] < 0.6 * files["model.safetensors"]["size"]
    got = _downloads(monkeypatch)
    folder = checkpoint.local_copy(url, so, require_complete=True, dtype="bfloat16")
    bf16_downloads = list(got)
    master = model.state_dict()
    served = _weights(folder)
    assert served.keys() == _weights(checkpoint.local_copy(url, so, require_complete=True, weights_only=True)).keys()
    for k, w in served.items():  # bit for bit what a bf16 engine makes of the float32 master
        assert w.dtype == torch.bfloat16 and torch.equal(w, master[k].to(torch.bfloat16)), k
    assert (
        json.loads(Path(folder, "config.json").read_text()).get(
            "dtype", json.loads(Path(folder, "config.json").read_text()).get("torch_dtype")
        )
        == "bfloat16"
    )
    from transformers import AutoModelForCausalLM

    assert next(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    if "://" in root:
        assert "bfloat16/model.safetensors" in bf16_downloads  # the bf16 copy, nothing of the master or its state
        assert not [g for g in bf16_downloads if not g.startswith("bfloat16/")]
    # a checkpoint without a copy serves its float32 root (no trainer state) to a bf16 loader
    plain = f"{root}/{RUN}/weights/step_000002"
    _save(plain, so, seed=2)
    assert _same_weights(
        _weights(checkpoint.local_copy(plain, so, require_complete=True, dtype="bfloat16")), _trained(2)[0].state_dict()
    )
    with pytest.raises(ValueError, match="serving_dtype='float16'"):
        checkpoint.save(plain, model=model, tokenizer=_Tok(), storage_options=so, serving_dtype="float16")


# ----------------------------------------------------------- 3. listing, resume fallback, complete-only loads
def test_stray_names_under_checkpoints_are_ignored(store):
    root, so = store
    ckpts = f"{root}/{RUN}/checkpoints"
    for step in (1, 3, 4):
        _save(f"{ckpts}/step_{step:06d}", so, seed=step, trainer_state=False)
    fs, path = _raw_fs(ckpts, so)
    fs.rm(f"{path}/step_000004/{checkpoint.COMPLETE}")  # incomplete
    for stray in ("step_abc", "step_000002.bak", ".step_000005.tmp-0a1b", "step_", "step_1x"):
        _put(fs, f"{path}/{stray}/{checkpoint.COMPLETE}", b"")
    _put(fs, f"{path}/notes", b"hello")
    assert checkpoint.list_complete(ckpts, so) == [(1, f"{ckpts}/step_000001"), (3, f"{ckpts}/step_000003")]
    checkpoint.prune(ckpts, 1, so)
    assert checkpoint.list_complete(ckpts, so) == [(3, f"{ckpts}/step_000003")]
    fs.invalidate_cache()
    assert fs.exists(f"{path}/step_abc/{checkpoint.COMPLETE}") and fs.exists(f"{path}/notes")  # strays untouched
    assert not fs.exists(f"{path}/step_000001")


def _resume(store, monkeypatch, tmp_path):
    from tasks import setup, tracking

    root, so = store
    updated = []

    class Client:
        def update_run(self, run_id, status):
            updated.append((run_id, status))

    monkeypatch.setattr(tracking, "client", lambda uri: Client())
    cfg = small_config(tmp_path, "unused-model", dataplane={"root": root, "storage_options": so})
    return setup._resume(cfg, RUN, "unused-model"), updated


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(store, tmp_path, monkeypatch, capsys):
    root, so = store
    ckpts = f"{root}/{RUN}/checkpoints"
    for step in (1, 2, 3):
        _save(f"{ckpts}/step_{step:06d}", so, seed=step, step=step)
    _damage(f"{ckpts}/step_000003", so, "model.safetensors", "flip")
    run, updated = _resume(store, monkeypatch, tmp_path)
    assert (run.start_step, run.start_policy_path, run.mlflow_run_id) == (2, f"{ckpts}/step_000002", "mlflow-1")
    assert updated == [("mlflow-1", "RUNNING")]
    err = capsys.readouterr().err
    assert "[grpoflow]" in err and f"{ckpts}/step_000003" in err and "model.safetensors is corrupt" in err


def test_resume_with_no_good_checkpoint_says_so(store, tmp_path, monkeypatch):
    root, so = store
    ckpts = f"{root}/{RUN}/checkpoints"
    for step in (1, 2):
        _save(f"{ckpts}/step_{step:06d}", so, seed=step, step=step)
        _damage(f"{ckpts}/step_{step:06d}", so, "trainer_state/optimizer.safetensors", "truncate")
    with pytest.raises(
        ValueError, match=r"none of the 2 complete checkpoints .* verifies.*optimizer\.safetensors is corrupt"
    ):
        _resume(store, monkeypatch, tmp_path)


def test_loaders_load_only_complete_checkpoints(store, tmp_path, monkeypatch):
    from tasks import finish

    root, so = store
    base = str(tmp_path / "base")  # step 0: the base model folder, which has no marker
    _model(0).save_pretrained(base)
    url = f"{root}/{RUN}/checkpoints/step_000001"
    _save(url, so, seed=1)
    fs, path = _raw_fs(url, so)
    marker = fs.cat_file(f"{path}/{checkpoint.COMPLETE}")
    fs.rm(f"{path}/{checkpoint.COMPLETE}")  # a torn checkpoint: all files there, no marker
    cfg = small_config(tmp_path, base, dataplane={"root": root, "storage_options": so})
    started = []
    monkeypatch.setattr(VLLMGeneration, "_start", lambda self, folder: started.append(folder))
    logged = []

    def hf_files(v):
        with finish.hf_folder(cfg, v) as folder:
            logged.extend(p.name for p in folder.iterdir())

    loaders = {
        "hf generation": lambda v: HFGeneration(cfg, tokenizer=None, model_path=base).refit(v),
        "vllm generation": lambda v: VLLMGeneration(cfg, tokenizer=None, model_path=base).refit(v),
        "hf policy": lambda v: HFPolicy(cfg, tokenizer=None, reference_path=base).load_checkpoint(
            v, with_optimizer=False
        ),
        "finish": hf_files,
    }
    for name, load in loaders.items():
        load(PolicyVersion(step=0, path=base))
        with pytest.raises(IntegrityError, match="is not complete"):
            load(PolicyVersion(step=1, path=url))
    fs.pipe_file(f"{path}/{checkpoint.COMPLETE}", marker)
    for name, load in loaders.items():
        load(PolicyVersion(step=1, path=url))
    assert len(started) == 2 and "model.safetensors" in logged


# ------------------------------------------------------------------------------ 4. transient failures
def test_transient_failures_of_every_storage_operation_are_retried(store, tmp_path, monkeypatch, capsys):
    """Every storage call fails once with a refused connection before it works: save (also over an earlier save),
    listing, verification, copying, pruning and resuming go through."""
    root, so = store
    failed: set[tuple[str, str]] = set()
    ops = {
        "put_file",
        "pipe_file",
        "rm",
        "get_file",
        "get",
        "put",
        "ls",
        "exists",
        "cat_file",
        "cat",
        "find",
        "info",
        "size",
        "open",
        "isdir",
        "isfile",
    }

    class Flaky:
        def __init__(self, fs):
            self._fs = fs

        def __getattr__(self, name):
            attr = getattr(self._fs, name)
            if name not in ops:
                return attr

            def call(*args, **kwargs):
                key = (name, str(args[0]) if args else "")
                if key not in failed:
                    failed.add(key)
                    raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused (injected)")
                return attr(*args, **kwargs)

            return call

    def url_to_fs(u, **kw):
        fs, path = _URL_TO_FS(u, **kw)
        return Flaky(fs), path

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
    fast = functools.partial(retry_transient, first_delay_s=0.001, max_delay_s=0.01)
    for module in (checkpoint, rl.manifest, rl.trainer_state):
        monkeypatch.setattr(module, "retry_transient", fast, raising=False)

    monkeypatch.setattr(dataplane.errors, "retry_transient", fast)  # what tasks.setup imports

    ckpts = f"{root}/{RUN}/checkpoints"
    for step in (1, 2):
        _save(f"{ckpts}/step_{step:06d}", so, seed=step, step=step)
    _save(f"{ckpts}/step_000002", so, seed=2, step=2)  # a re-save: removes before it uploads
    assert checkpoint.list_complete(ckpts, so) == [(1, f"{ckpts}/step_000001"), (2, f"{ckpts}/step_000002")]
    assert checkpoint.is_complete(f"{ckpts}/step_000002", so) and checkpoint.has_trainer_state(
        f"{ckpts}/step_000002", so
    )
    checkpoint.verify(f"{ckpts}/step_000002", so)
    folder = checkpoint.local_copy(f"{ckpts}/step_000002", so, require_complete=True)
    assert _same_weights(_weights(folder), _trained(2)[0].state_dict())
    run, _ = _resume(store, monkeypatch, tmp_path)
    assert run.start_step == 2
    checkpoint.prune(ckpts, 1, so)
    monkeypatch.undo()
    assert checkpoint.list_complete(ckpts, so) == [(2, f"{ckpts}/step_000002")]
    err = capsys.readouterr().err
    assert "transient ConnectionRefusedError" in err and f"checkpoint {ckpts}/step_000002: read _COMPLETE" in err
    if root.startswith("s3://"):
        assert f"checkpoint {ckpts}/step_000002: upload model.safetensors" in err
    assert {name for name, _ in failed} >= (
        {"cat_file", "exists", "ls", "rm"} | ({"put_file", "open"} if root.startswith("s3://") else set())
    )


class _LateProxy:
    """A TCP port on loopback that drops every connection (a reset) for ``delay_s`` seconds from the first one, then
    forwards to ``target``. The outage starts with the first connection, not with the proxy: building the model
    before the first request takes seconds on a loaded machine, and an outage that is over by then tests nothing."""

    def __init__(self, target: str, delay_s: float) -> None:
        host, port = target.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(delay_s,), daemon=True)
        self._thread.start()

    def _serve(self, delay_s: float) -> None:
        first = None
        with self._srv as srv:
            srv.settimeout(0.2)
            while not self._stop.is_set():
                try:
                    client, _ = srv.accept()
                except TimeoutError:
                    continue
                first = time.monotonic() if first is None else first
                if time.monotonic() - first < delay_s:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    client.close()  # linger 0: a reset, as a dropped connection
                    self.dropped += 1
                    continue
                upstream = socket.create_connection(self._target)
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_an_s3_endpoint_dropping_connections_for_a_while_does_not_fail_a_save(s3_server, monkeypatch, capsys):
    """A real outage: the endpoint resets every connection for 4 s, with s3fs's and botocore's own retries turned down
    so that they give up well within it (as they do within an outage of ~30 s). Only loopback S3: a local folder
    has no endpoint."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    proxy = _LateProxy(s3_server, delay_s=4.0)
    so = {
        "endpoint_url": f"http://127.0.0.1:{proxy.port}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    url = f"s3://grpoflow/outage-{uuid.uuid4().hex}/{RUN}/checkpoints/step_000001"
    try:
        started = time.monotonic()
        _save(url, so, seed=1)
        assert time.monotonic() - started > 3.5  # it did wait out the outage
        assert checkpoint.list_complete(url.rsplit("/", 1)[0], so) == [(1, url)]
        checkpoint.verify(url, so)
    finally:
        proxy.close()
    err = capsys.readouterr().err
    assert "[grpoflow] checkpoint s3://" in err and "transient" in err
