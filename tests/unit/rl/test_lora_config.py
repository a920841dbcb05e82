"""``policy.lora``: the optional LoRA section of the run config, from YAML, JSON and flytekit literals, and its
checks."""

from __future__ import annotations

import json

import pytest

from rl.config import (
    LORA_ALL_LINEAR,
    GRPOConfig,
    LoRASettings,
    PolicyConfig,
    config_from_dict,
    config_from_json,
    load_config,
)
from rl.config.checks import section_name, section_type, sections


def _lora(**values) -> GRPOConfig:
    return config_from_dict({"policy": {"lora": values}})


def test_defaults_are_full_fine_tuning_and_peft_s_lora():
    assert GRPOConfig().policy.lora is None
    s = LoRASettings()
    assert (s.rank, s.alpha, s.dropout, s.target_modules) == (16, 32.0, 0.0, ["all-linear"])
    assert s.peft_target_modules == "all-linear" == LORA_ALL_LINEAR
    assert ("policy.lora", LoRASettings) in sections(GRPOConfig)
    assert section_name(LoRASettings) == "policy.lora"


def test_section_type_reads_required_and_optional_sections():
    assert section_type(LoRASettings) is LoRASettings
    assert section_type(LoRASettings | None) is LoRASettings
    assert section_type(int | None) is None
    assert section_type(dict) is None
    assert section_type(None) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("policy:\n  lora:\n    rank: 8\n", LoRASettings(rank=8)),
        ("policy:\n  lora: {}\n", LoRASettings()),
        ("policy:\n  lora: null\n", None),
        ("policy:\n  lora:\n", None),  # an empty YAML value is null
        ("policy:\n  nnodes: 1\n", None),
        ("grpo:\n  max_num_steps: 2\n", None),
    ],
)
def test_yaml_mapping_null_or_missing(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(str(path)).policy.lora == expected


def test_yaml_all_settings_and_both_target_module_forms(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  lora:\n    rank: 4\n    alpha: 8\n    dropout: 0.05\n    target_modules: all-linear\n")
    lora = load_config(str(path)).policy.lora
    assert lora == LoRASettings(rank=4, alpha=8.0, dropout=0.05, target_modules=["all-linear"])
    assert type(lora.alpha) is float and lora.peft_target_modules == "all-linear"
    path.write_text("policy:\n  lora:\n    target_modules: [all-linear]\n")
    assert load_config(str(path)).policy.lora.peft_target_modules == "all-linear"
    path.write_text("policy:\n  lora:\n    target_modules: [q_proj, v_proj]\n")
    lora = load_config(str(path)).policy.lora
    names = lora.peft_target_modules
    assert names == ["q_proj", "v_proj"]
    names.append("o_proj")  # a new list: the config is not changed through it
    assert lora.target_modules == ["q_proj", "v_proj"]


def test_json_mapping_null_and_a_dict_round_trip():
    assert GRPOConfig.from_json('{"policy": {"lora": {"rank": 4}}}').policy.lora == LoRASettings(rank=4)
    assert GRPOConfig.from_json('{"policy": {"lora": null}}').policy.lora is None
    for cfg in (_lora(target_modules=["q_proj", "self_attn.o_proj"]), GRPOConfig()):
        assert config_from_json(json.dumps(cfg.to_dict())) == cfg


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"rank": 0}, "config policy.lora.rank: is 0; use a rank of 1 or more, e.g. 8 or 16"),
        ({"rank": -4}, "config policy.lora.rank: is -4; use a rank of 1 or more"),
        ({"rank": 2.5}, "config policy.lora.rank: expected a whole number, got the number 2.5"),
        ({"alpha": 0}, "config policy.lora.alpha: is 0.0; use a positive scale, e.g. twice the rank"),
        ({"alpha": -1.0}, "config policy.lora.alpha: is -1.0; use a positive scale"),
        ({"alpha": float("nan")}, "config policy.lora.alpha: expected a finite number, got the number nan"),
        ({"alpha": float("inf")}, "config policy.lora.alpha: expected a finite number, got the number inf"),
        ({"dropout": 1.0}, "config policy.lora.dropout: is 1.0; use a probability in [0, 1), e.g. 0 or 0.05"),
        ({"dropout": -0.1}, "config policy.lora.dropout: is -0.1; use a probability in [0, 1)"),
        ({"target_modules": []}, "config policy.lora.target_modules: is empty; list module names such as [q_proj"),
        (
            {"target_modules": "q_proj"},
            "config policy.lora.target_modules: is the string 'q_proj'; write a list of module names such as "
            "[q_proj], or all-linear",
        ),
        ({"target_modules": 3}, "config policy.lora.target_modules: expected a list, got the number 3"),
        ({"target_modules": [1]}, "config policy.lora.target_modules[0]: expected a string, got the number 1"),
        ({"target_modules": ["q_proj", ""]}, "config policy.lora.target_modules[1]: is ''; name a module"),
        ({"target_modules": ["  "]}, "config policy.lora.target_modules[0]: is '  '; name a module"),
        (
            {"target_modules": [" q_proj"]},
            "config policy.lora.target_modules[0]: ' q_proj' has leading or trailing spaces; write 'q_proj'",
        ),
        (
            {"target_modules": ["all-linear", "q_proj"]},
            "config policy.lora.target_modules: mixes 'all-linear', which takes every linear layer, with the module "
            "names ['q_proj']; write all-linear alone, or list only module names",
        ),
        ({"r": 8}, "config policy.lora: unknown keys ['r']; use only ['alpha', 'dropout', 'rank', 'target_modules']"),
    ],
)
def test_bad_values_are_refused_naming_the_key(values, match):
    with pytest.raises(ValueError) as err:
        _lora(**values)
    assert match in str(err.value)


@pytest.mark.parametrize("value", [8, "all-linear", [8], True])
def test_a_value_that_is_not_a_mapping_is_refused(value):
    with pytest.raises(ValueError, match=r"^config policy.lora: expected a mapping, got "):
        config_from_dict({"policy": {"lora": value}})


def test_a_required_section_still_refuses_null():
    with pytest.raises(ValueError, match=r"^config grpo: expected a mapping, got NoneType"):
        config_from_dict({"grpo": None})


def test_sections_built_directly_are_checked():
    with pytest.raises(ValueError, match=r"config policy.lora: expected a LoRASettings section, got a mapping"):
        PolicyConfig(lora={"rank": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"config policy.lora.rank: expected a whole number, got the string '8'"):
        LoRASettings(rank="8")  # type: ignore[arg-type]
    assert LoRASettings(target_modules="all-linear").target_modules == ["all-linear"]  # type: ignore[arg-type]


def test_megatron_back_end_refuses_lora():
    with pytest.raises(ValueError) as err:
        config_from_dict({"policy": {"backend": "megatron", "lora": {"rank": 8}}})
    message = str(err.value)
    assert message.startswith("config policy.lora: is set with policy.backend 'megatron'")
    assert "LoRA adapters are built with peft on the transformers back-end only" in message
    assert message.endswith("; set policy.backend to transformers, or remove policy.lora (null) to train every weight")
    assert config_from_dict({"policy": {"backend": "megatron", "lora": None}}).policy.lora is None


def test_flat_params_hold_the_lora_settings():
    params = _lora(rank=8, target_modules=["q_proj", "v_proj"]).flat_params()
    assert {k: v for k, v in params.items() if k.startswith("policy.lora")} == {
        "policy.lora.rank": "8",
        "policy.lora.alpha": "32.0",
        "policy.lora.dropout": "0.0",
        "policy.lora.target_modules": '["q_proj", "v_proj"]',
    }
    assert GRPOConfig().flat_params()["policy.lora"] == "None"


def _round_trip(cfg: GRPOConfig) -> GRPOConfig:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, cfg, GRPOConfig, TypeEngine.to_literal_type(GRPOConfig))
    return TypeEngine.to_python_value(ctx, literal, GRPOConfig)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flytekit's import of click.__version__
@pytest.mark.parametrize(
    "lora", [None, {}, {"rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}]
)
def test_flytekit_round_trip(lora):
    cfg = config_from_dict({"policy": {"lora": lora}})
    back = _round_trip(cfg)
    assert back == cfg
    if lora is not None:
        assert type(back.policy.lora) is LoRASettings and type(back.policy.lora.alpha) is float


def _task_input(lora):
    """A GRPOConfig literal as a task receives one built outside our dataclass (a dict, the console's launch form)."""
    import msgpack
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Binary, Literal, Scalar

    data = GRPOConfig().to_dict()
    data["policy"]["lora"] = lora
    literal = Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(data), tag="msgpack")))
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), literal, GRPOConfig)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_task_input_is_checked_not_coerced():
    good = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]}
    assert _task_input(good).policy.lora == LoRASettings(rank=8, alpha=16.0, target_modules=["q_proj"])
    assert _task_input(None).policy.lora is None
    with pytest.raises(ValueError) as err:
        _task_input({**good, "rank": 3.5})  # mashumaro alone would make int(3.5) = 3
    chain = []
    exc: BaseException | None = err.value
    while exc is not None:  # mashumaro wraps our error of a nested section in InvalidFieldValue
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any("config policy.lora.rank: expected a whole number" in message for message in chain), chain
