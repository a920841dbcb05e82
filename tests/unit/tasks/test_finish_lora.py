"""A LoRA run's final model: `finish_run` logs the adapter only, through MLflow's peft support, with its base named
and no network; it loads back as the trained model; `tasks.export_merged` writes the merged model as a plain HF
folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import small_config
from tests.integration.test_mlflow_model import no_network  # noqa: F401 (a fixture: every connection fails)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
IDS = torch.tensor([[1, 5, 9, 200, 3000, 7]])


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, tiny_model_dir):
    """``(checkpoint url, base folder)``: a complete LoRA checkpoint (adapter, tokenizer, trainer state) of the tiny
    model, its B matrices non-zero (a trained adapter: the merged model differs from the base)."""
    from rl import checkpoint, lora
    from rl.backends.hf.model import load_model
    from rl.config.sections import LoRASettings
    from rl.model import load_tokenizer

    torch.manual_seed(0)
    peft_model = lora.wrap(load_model(tiny_model_dir, device="cpu"), LoRASettings(rank=4, alpha=8.0), seed=1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    state = checkpoint.TrainerState(step=3, mlflow_run_id="unused", extra={})
    url = str(tmp_path_factory.mktemp("lora") / "dp" / "run-1" / "checkpoints" / "step_000003")
    tok = load_tokenizer(tiny_model_dir)
    checkpoint.save(url, model=peft_model, tokenizer=tok, optimizer=optimizer, state=state)
    return url, tiny_model_dir


@pytest.fixture(scope="module")
def merged_logits(lora_checkpoint):
    """Logits of :data:`IDS` under the merged model (``rl.lora.merged_model``) and under the base alone."""
    from rl.backends.hf.model import load_model
    from rl.lora import merged_model

    url, base = lora_checkpoint
    with torch.no_grad():
        return merged_model(base, url, device="cpu")(IDS).logits, load_model(base, device="cpu")(IDS).logits


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def test_base_model_name_maps_the_default_model_to_its_hub_repository():
    from tasks.finish import base_model_name

    assert base_model_name("SmolLM2-135M-Instruct") == HUB_ID
    assert base_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert "secret" not in base_model_name("s3://key:secret@bucket/models/abc")


def test_the_summary_of_an_adapter_names_its_base_and_the_merge_command(tmp_path):
    from tasks.finish import adapter_lines
    from tasks.types import PolicyVersion, RunInfo

    cfg = small_config(tmp_path, "SmolLM2-135M-Instruct")
    run = RunInfo(run_id="r", mlflow_run_id="m", model_path="s3://key:secret@b/models/abc", start_policy_path="")
    lines = adapter_lines(cfg, run, PolicyVersion(step=3, path="s3://b/run/checkpoints/step_000003"))
    assert lines == [
        f"it is a LoRA adapter on {HUB_ID} (base weights: s3://***@b/models/abc); load_model takes the base from "
        "where this run loaded it; elsewhere pass base_model_path=<a copy of it>",
        "merged model folder: python -m tasks.export_merged --checkpoint s3://b/run/checkpoints/step_000003 "
        "--base 's3://***@b/models/abc' --out <new folder>",
    ]


def test_hf_folder_of_a_lora_checkpoint_holds_the_adapter_and_tokenizer(tmp_path, lora_checkpoint):
    from tasks import finish
    from tasks.types import PolicyVersion

    url, base = lora_checkpoint
    cfg = small_config(tmp_path, base)
    with finish.hf_folder(cfg, PolicyVersion(step=3, path=url)) as folder:
        names = sorted(p.name for p in folder.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(names)
    assert "_COMPLETE" not in names and "trainer_state" not in names and "config.json" not in names

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="neither config.json nor adapter_config.json"):
        with finish.hf_folder(cfg, PolicyVersion(step=0, path=str(empty))):
            pass


def test_lora_final_model_is_the_adapter_on_its_named_base_and_loads_back_offline(
    tmp_path, lora_checkpoint, merged_logits, request
):
    import mlflow
    import mlflow.transformers
    from mlflow.tracking import MlflowClient

    from tasks import tracking
    from tasks.finish import PEFT_ADAPTOR, log_model_and_end_run
    from tasks.types import PolicyVersion, RunInfo

    tried = request.getfixturevalue("no_network")  # every connection from here on fails, and is listed
    url, base = lora_checkpoint
    cfg = small_config(tmp_path, "SmolLM2-135M-Instruct")  # named as the default; its weights: the tiny model
    uri = cfg.tracking.uri
    run_id = tracking.start_run(uri=uri, experiment_name="test", run_name=None, params={}, tags={})
    run = RunInfo(run_id="run-1", mlflow_run_id=run_id, model_path=base, start_policy_path=base)

    info = log_model_and_end_run(cfg, run, PolicyVersion(step=3, path=url))

    assert tried == []  # nothing tried the hub
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert info.flavors["transformers"][PEFT_ADAPTOR] == "peft"

    mlflow.set_tracking_uri(uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", dst_path=str(tmp_path / "dl")))
        loaded = mlflow.transformers.load_model(f"runs:/{run_id}/model", return_type="components")
        copy = shutil.copytree(base, tmp_path / "elsewhere")  # the base at another path (another machine)
        moved = mlflow.transformers.load_model(
            f"runs:/{run_id}/model", return_type="components", base_model_path=str(copy)
        )
    finally:
        mlflow.set_tracking_uri(None)

    import yaml

    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    flavor = mlmodel["flavors"]["transformers"]
    assert flavor["peft_adaptor"] == "peft" and flavor["source_model_name"] == HUB_ID
    assert Path(flavor["local_base_model_path"]) == Path(base).resolve()
    assert mlmodel["metadata"]["base_model"] == HUB_ID
    assert mlmodel["metadata"]["export_merged"].startswith(f"python -m tasks.export_merged --checkpoint {url} ")
    weights = sorted(str(p.relative_to(local)) for p in local.rglob("*.safetensors"))
    assert weights == ["peft/adapter_model.safetensors"]  # the adapter only: no base weights
    base_bytes = (Path(base) / "model.safetensors").stat().st_size
    assert (local / weights[0]).stat().st_size < base_bytes / 4
    assert any(r.startswith("peft==") for r in (local / "requirements.txt").read_text().split())
    assert yaml.safe_load((local / "model_card_data.yaml").read_text())["base_model"] == HUB_ID

    want, base_only = merged_logits
    assert (want - base_only).abs().max() > 1e-3  # the adapter changes the model
    for components in (loaded, moved):
        assert type(components["model"]).__name__ == "PeftModelForCausalLM"
        torch.testing.assert_close(_logits(components["model"]), want, atol=1e-5, rtol=0)


def test_export_merged_writes_the_merged_model_as_a_plain_hf_folder(tmp_path, lora_checkpoint, merged_logits):
    from transformers import AutoModelForCausalLM

    from rl.lora import merged_model
    from tasks.export_merged import export_merged

    url, base = lora_checkpoint
    out = export_merged(url, tmp_path / "merged")  # the base: the folder the adapter records (a local run's)

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.startswith("adapter_") for n in names) and not list(tmp_path.glob(".merged.tmp-*"))
    model = AutoModelForCausalLM.from_pretrained(out)
    want = merged_model(base, url, device="cpu").state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    torch.testing.assert_close(_logits(model), merged_logits[0], atol=1e-5, rtol=0)


def test_export_merged_cli_dtype_and_errors(tmp_path, lora_checkpoint, capsys):
    from rl import checkpoint, lora
    from rl.backends.hf.model import load_model
    from rl.config.sections import LoRASettings
    from rl.model import load_tokenizer
    from tasks.export_merged import main

    url, base = lora_checkpoint
    out = tmp_path / "bf16"
    assert main(["--checkpoint", url, "--base", base, "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert f"merged model written to {out}" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    assert main(["--checkpoint", url, "--out", str(out)]) == 1  # not empty
    assert "exists and is not an empty folder" in capsys.readouterr().err

    full = tmp_path / "full"  # a full fine-tuning checkpoint: no adapter
    checkpoint.save(str(full), model=load_model(base, device="cpu"), tokenizer=load_tokenizer(base))
    assert main(["--checkpoint", str(full), "--out", str(tmp_path / "x")]) == 1
    assert "holds no LoRA adapter (no adapter_config.json)" in capsys.readouterr().err

    gone = shutil.copytree(base, tmp_path / "gone")  # an adapter trained on a base folder that is gone since
    moved = str(tmp_path / "moved")
    peft_model = lora.wrap(load_model(str(gone), device="cpu"), LoRASettings(rank=2), seed=0)
    checkpoint.save(moved, model=peft_model, tokenizer=load_tokenizer(base))
    shutil.rmtree(gone)
    assert main(["--checkpoint", moved, "--out", str(tmp_path / "y")]) == 1
    assert f"trained on the base model {str(gone)!r}, which is not a folder on this machine: pass --base" in (
        capsys.readouterr().err
    )
    assert main(["--checkpoint", moved, "--base", base, "--out", str(tmp_path / "y")]) == 0

    with pytest.raises(SystemExit):
        main(["--checkpoint", url, "--out", str(tmp_path / "z"), "--storage-options", "[1]"])
    assert "--storage-options is [1]: write a JSON object" in capsys.readouterr().err
