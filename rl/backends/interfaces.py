"""The two back-end interfaces: generation (rollouts) and policy (logprobs, training, checkpoints).

Tensors in, tensors out; no Flyte, no data plane. Mirrors NeMo-RL's ``GenerationInterface`` / ``PolicyInterface``
(``reference/seeds/policy_interfaces.txt``); the data-plane entry points of its ``TQPolicy`` are
:class:`rl.backends.dataplane_policy.DataPlanePolicy`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: tasks import this module for PolicyVersion
    import torch


@dataclass
class PolicyVersion:
    """The policy weights after ``step`` optimizer steps, at ``path`` (an HF folder URL: local or fsspec)."""

    step: int
    path: str


@dataclass
class Generated:
    """N completions, group-contiguous: row ``b * G + i`` is completion ``i`` of prompt ``b``.

    Attributes:
        input_ids: N int64 [L_i] tensors, prompt + response tokens.
        generation_logprobs: N float32 [L_i], log p(token_t | <t) in nats under the sampling distribution
            (logits / temperature; the unscaled logits when greedy), 0 on prompt tokens.
        token_mask: N bool [L_i], True on response tokens.
        prompt_lengths, response_lengths: [N] int64.
        truncated: [N] bool, True where no eos was generated within ``max_new_tokens``.
        response_token_ids: N lists of response token ids (the eos included when generated).
    """

    input_ids: list[torch.Tensor]
    generation_logprobs: list[torch.Tensor]
    token_mask: list[torch.Tensor]
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    response_token_ids: list[list[int]]

    @classmethod
    def from_rows(
        cls, prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]], finished: list[bool]
    ) -> Generated:
        """Assemble from per-row prompt ids, response ids, response-token logprobs and whether eos ended the row."""
        import torch

        out = cls(
            [],
            [],
            [],
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.bool),
            [],
        )
        for p, r, lp in zip(prompts, responses, logprobs, strict=True):
            out.input_ids.append(torch.tensor([*p, *r], dtype=torch.int64))
            out.generation_logprobs.append(torch.cat([torch.zeros(len(p)), torch.as_tensor(lp, dtype=torch.float32)]))
            out.token_mask.append(
                torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(len(r), dtype=torch.bool)])
            )
            out.response_token_ids.append(list(r))
        out.prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        out.response_lengths = torch.tensor([len(r) for r in responses], dtype=torch.int64)
        out.truncated = ~torch.tensor(finished, dtype=torch.bool)
        return out


@dataclass
class TopkLogits:
    """Per-position top-k logits, aligned to next-token positions: entry ``t`` predicts token ``t + 1``.

    Attributes:
        topk_logits: [N, S-1, k] float32, descending along k; 0 at positions t >= input_lengths - 1.
        topk_indices: [N, S-1, k] int64, global vocabulary ids; 0 at those positions.
    """

    topk_logits: torch.Tensor
    topk_indices: torch.Tensor


class GenerationBackend(abc.ABC):
    """Generates G completions per prompt with the weights of one :class:`PolicyVersion`.

    Sampling settings (temperature, top_p, max_new_tokens) come from ``cfg.generation`` at construction; the
    seed comes with every call, so the same (weights, prompts, seed) give the same completions whatever ran
    before in the process, where the back-end is reproducible: always for transformers; for vLLM where requests
    carry their own seeds (``generation.vllm_cfg.seed_per_request``, null following ``optim.deterministic``: on for
    the CPU, off for CUDA, where unseeded requests keep vLLM's faster sampler).

    ``generation_logprobs`` are log softmax(logits / temperature) over the whole vocabulary, before top-p truncation:
    the quantity the trainer computes, on every back-end.
    """

    name: str = ""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int | None:
        """Step of the weights the engine holds (None before the first load)."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        stop_strings: list[list[str] | None] | None = None,
    ) -> Generated:
        """``group_size`` completions of each of the B prompts.

        Args:
            prompts: B prompt token-id lists.
            group_size: G completions per prompt (1 for validation).
            seed: seeds this call's sampling only (a local generator; per-request seeds in vLLM where they are on).
            greedy: argmax decoding; the logprobs are then those of the unscaled logits.
            stop_strings: [B] per prompt the strings after which its completions end (the stop string kept, and the
                completion counted as finished: vLLM's ``stop`` with ``include_stop_str_in_output``), or None. A
                completion may run past the token that completes a stop string (by up to that token's own tail);
                the multi-turn loop cuts it there (`rl.multi_turn.cut_at_stop_string`).

        Returns:
            :class:`Generated` with N = B * G rows, group-contiguous.

        Raises:
            ValueError: a prompt plus ``generation.max_new_tokens`` does not fit the context (the model's
                positions, or vLLM's ``max_model_len``): :func:`rl.lengths.check_fits`.
        """

    @abc.abstractmethod
    def refit(self, version: PolicyVersion, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Hold the weights of ``version``: updated in place from ``weights`` (HF parameter names, e.g. the live
        trainer's state dict in a warm process), or loaded from ``version.path`` when ``weights`` is None (a
        cold process)."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Release the engine and its memory; True when done."""


class PolicyBackend(abc.ABC):
    """A trainable policy plus its frozen reference policy (the base model), behind tensor-level methods.

    Batches are mappings of padded tensors as the data plane materializes them: ``input_ids`` [N, S] int64
    (right-padded), ``input_lengths`` [N] int64, ``token_mask`` [N, S] bool, ``sample_mask`` [N] bool, and for
    ``train`` also ``generation_logprobs``, ``reference_policy_logprobs``, ``advantages`` (and optionally
    ``prev_logprobs``) [N, S] float32. Logprob outputs are [N, S] float32 aligned with ``input_ids``: entry t is
    log p(input_ids[t] | input_ids[<t]) in nats on ``token_mask`` tokens, 0 elsewhere (position 0 included).
    """

    name: str = ""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int | None:
        """Step of the policy weights held (None before the first load)."""

    @property
    @abc.abstractmethod
    def pad_token_id(self) -> int:
        """Pad value of ``input_ids`` when the data plane materializes a batch."""

    @abc.abstractmethod
    def get_logprobs(self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None) -> torch.Tensor:
        """[N, S] float32 logprobs of the batch under the policy (no gradients)."""

    def load_reference_policy(self) -> None:
        """Load the reference policy now; otherwise the first reference call loads it (a task calls this first, so
        that its ``timing/<task>/startup`` covers the load)."""

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """[N, S] float32 logprobs of the batch under the reference policy."""

    @abc.abstractmethod
    def get_topk_logits(
        self, batch: Mapping[str, torch.Tensor], k: int, *, micro_batch_size: int | None = None
    ) -> TopkLogits:
        """Top-``k`` logits of the policy at the S-1 next-token positions (see :class:`TopkLogits`)."""

    @abc.abstractmethod
    def train(
        self, batch: Mapping[str, torch.Tensor], *, update_sizes: Sequence[int] | None = None
    ) -> dict[str, float]:
        """One step's optimizer updates on ``batch``; bumps :attr:`weight_version` by one.

        Args:
            batch: the step's rows (this rank's shard of them under data parallelism: ``rl.distributed``).
            update_sizes: rows of ``batch`` in each optimizer update, in order (this rank's part of each global
                update, possibly 0); None: ``optim.train_global_batch_size`` rows per update.

        Returns:
            metrics named as NeMo-RL logs them without the ``train/`` prefix (``loss``, ``grad_norm``, ...), over
            the whole step: sums and means over every rank's tokens, the same on every rank.
        """

    @abc.abstractmethod
    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy weights under Hugging Face parameter names, for :meth:`GenerationBackend.refit`; tied tensors
        under each of their names (``lm_head.weight`` beside ``model.embed_tokens.weight``): an engine may have untied
        them."""

    @abc.abstractmethod
    def save_checkpoint(self, url: str, *, trainer_state: Any | None = None, serving_dtype: str | None = None) -> str:
        """Write an HF folder of the policy at ``url`` (``from_pretrained`` loads it); with ``trainer_state``
        (an :class:`rl.checkpoint.TrainerState`) also optimizer, scheduler and RNG state; with ``serving_dtype``
        (``"bfloat16"``) also a copy of the weights in it for generation pods (:func:`rl.checkpoint.save`).
        Returns ``url``."""

    @abc.abstractmethod
    def load_checkpoint(self, version: PolicyVersion, *, with_optimizer: bool) -> None:
        """Hold the weights of ``version`` (and, with ``with_optimizer``, its optimizer state: fresh at step 0).

        Raises:
            RuntimeError: ``with_optimizer`` but the checkpoint at ``version.path`` has no trainer state.
        """

    @abc.abstractmethod
    def has_optimizer_state(self, version: PolicyVersion) -> bool:
        """Whether this object holds the optimizer state that belongs to ``version``."""

    @abc.abstractmethod
    def prepare_for_training(self) -> None:
        """Ready the policy for :meth:`train` (train mode; the optimizer exists)."""

    @abc.abstractmethod
    def finish_training(self) -> None:
        """Back to inference after training (eval mode, gradients freed)."""

    def calibrate_qkv_fp8_scales(self, batch: Mapping[str, torch.Tensor], **kwargs: Any) -> dict[str, Any]:
        """FP8 KV-cache scales for Q/K/V (NeMo-RL). Back-ends without FP8 KV caches raise.

        Raises:
            NotImplementedError: always, unless a back-end overrides it.
        """
        msg = (
            f"the {self.name!r} policy back-end has no FP8 KV cache, so there are no Q/K/V scales to calibrate; "
            "leave FP8 KV caches off (they need a GPU back-end that supports them)"
        )
        raise NotImplementedError(msg)

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Release models and optimizer state; True when done."""

    # ------------------------------------------------------------ ranks (rl.distributed)
    def data_parallel(self) -> tuple[int, int]:
        """``(rank, size)`` of this process among the data-parallel replicas, each of which reads its own shard of a
        step. Every rank is a replica unless the back-end splits the model over several ranks (Megatron-core's
        tensor, pipeline and context parallelism: those ranks share one shard)."""
        from rl import distributed

        return distributed.rank(), distributed.world_size()

    def writes_outputs(self) -> bool:
        """Whether this rank writes its replica's logprobs and counts its tokens: one rank per replica."""
        return True

    def prepare_checkpoint(self, *, with_trainer_state: bool) -> None:
        """Collective, called by every rank after :meth:`train` and before rank 0 calls :meth:`save_checkpoint` or
        :meth:`named_weights`: bring what those need onto rank 0. Nothing to do where rank 0 holds the whole model."""
