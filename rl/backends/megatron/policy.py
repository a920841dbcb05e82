"""The Megatron-core policy back-end: megatron-core's GPT model built from our HF checkpoint, split over tensor,
pipeline and context parallel ranks (``policy.megatron_cfg``), behind :class:`rl.backends.interfaces.PolicyBackend`.

What is shared with the transformers back-end: the loss (`rl.loss.clipped_pg_loss`, normalized by the global token
and sequence counts), AdamW with its warmup (`rl.backends.engine.make_optimizer`), the step metrics and the
checkpoint format: every checkpoint is an HF folder (`rl.backends.megatron.model.HFFolder`), so validation, MLflow and
vLLM refits read the same files whatever trained them.

How it runs (Megatron-LM's training loop, reduced to what GRPO needs):
- micro-batches go through megatron-core's pipeline schedule (``get_forward_backward_func``); its loss function runs
  on the last stage, on this context-parallel rank's part of each sequence (`rl.backends.megatron.parallel`), with
  token logprobs over the vocabulary split across tensor-parallel ranks (``vocab_parallel_cross_entropy``);
- parameters are float32 and forward passes run under ``torch.autocast`` in ``model.precision`` (as in the
  transformers back-end), so checkpoints hold the float32 master weights exactly; the LM head runs only on the
  positions that predict a wanted token, in the compute dtype with float32 logits
  (`rl.backends.megatron.model.selective_lm_head`);
- the update's loop, loss, optimizer and metrics are the shared engine's (`rl.backends.engine`); this back-end gives
  it the forward and backward of micro-batches and its gradient reduction (`rl.backends.megatron.train`);
- after the last micro-batch of an update the gradients are summed over the data- and context-parallel ranks
  (`rl.distributed.all_reduce_gradients`), the tied embedding's over the first and last pipeline stages and the
  sequence-parallel layernorms' over the tensor-parallel ranks (megatron-core's ``finalize_model_grads`` does the
  same for its DDP wrapper); the norm is megatron-core's model-parallel one (``get_grad_norm_fp32``), the clipping
  torch's.

Deviation from NeMo-RL's Megatron worker: bf16 compute under autocast with float32 parameters and torch's AdamW instead
of megatron-core's bf16 parameters with float32 master copies in its optimizer (more memory, exact checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dataplane import fields as F
from rl import checkpoint
from rl.backends import registry
from rl.backends.interfaces import PolicyVersion, TopkLogits
from rl.backends.megatron.convert import LlamaLayout
from rl.backends.megatron.model import (
    HFFolder,
    build_gpt_model,
    gather_hf_state_dict,
    gather_to_rank0,
    init_model_parallel,
    load_hf_state_dict,
)
from rl.backends.megatron.parallel import (
    context_parallel_merge,
    context_parallel_split,
    padded_length,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk,
)
from rl.backends.megatron.train import MegatronTrainEngine
from rl.backends.micro_batch import CPU_MICRO_BATCH_ROWS, micro_batch_limits, micro_batch_slices
from rl.backends.policy_base import TrainablePolicy
from rl.config import GRPOConfig
from rl.model import model_construction
from rl.precision import autocast, resolve


class MegatronPolicy(TrainablePolicy):
    """megatron-core's GPT model with AdamW, and the base model as the reference policy.

    Loads lazily, as the transformers back-end: the policy on :meth:`load_checkpoint`, the optimizer when training
    asks for it, the reference policy on the first reference call. Every rank of a train or logprob task holds its
    shard; all of them call every method (they are collective), and rank 0 alone saves.

    Args:
        cfg: the run's config (``policy.megatron_cfg``, ``model.precision``, ``optim``, ``loss``,
            ``generation.temperature``).
        tokenizer: the model's tokenizer (saved into every checkpoint).
        reference_path: the base model folder (the reference policy; its ``config.json`` gives the architecture).

    Raises:
        ImportError, RuntimeError: on first use, when megatron-core or a CUDA GPU is missing
            (``rl.backends.registry.check_installed``).
    """

    name = "megatron"

    def __init__(self, cfg: GRPOConfig, *, tokenizer: Any, reference_path: str) -> None:
        super().__init__(cfg, tokenizer=tokenizer, reference_path=reference_path)
        self._mcfg = cfg.policy.megatron_cfg
        self._hf_config: Any = None
        self._layout: Any = None
        self._gathered: tuple[int, dict[str, torch.Tensor], dict[str, Any] | None] | None = None

    # ------------------------------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Once per process: check megatron-core and CUDA, read the architecture, split the ranks into groups."""
        if self._layout is not None:
            return
        from transformers import AutoConfig

        self._check_installed()
        self._hf_config = AutoConfig.from_pretrained(self._reference_path)
        self._layout = LlamaLayout.from_hf_config(self._hf_config)
        init_model_parallel(self._mcfg, seed=self._cfg.grpo.seed)

    def _check_installed(self) -> None:
        """Raise, saying what to install or where to run, without megatron-core or a CUDA GPU."""

        registry.check_installed("policy", self.name)

    def _build(self, path: str) -> torch.nn.Module:
        """This rank's shard of the model with the weights of the HF folder at ``path`` (local)."""
        from transformers import AutoModelForCausalLM

        bf16 = resolve(self._cfg.model.precision, self.device) == "bfloat16"
        model = build_gpt_model(
            self._layout,
            self._hf_config,
            self._mcfg,
            device=self.device,
            compute_dtype=torch.bfloat16 if bf16 else torch.float32,
        )

        with model_construction():  # transformers' loading switches process-wide state (rl.model.model_construction)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        load_hf_state_dict(model, hf, self._layout, self._mcfg)
        return model

    def _load_weights(self, folder: str) -> torch.nn.Module:
        return self._build(folder)

    def _optimizer_shard(self) -> str | None:
        return self._shard

    def _drop_optimizer(self) -> None:
        super()._drop_optimizer()
        self._gathered = None  # gathered from the weights and optimizer just dropped

    @property
    def device(self) -> torch.device:
        """This rank's GPU (``LOCAL_RANK``'s, set by ``rl.distributed.process_group``)."""
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def _shard(self) -> str:
        """This rank's model-parallel shard, the name of its optimizer state in a checkpoint."""
        from megatron.core import parallel_state

        tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        return f"megatron-tp{tp}-pp{pp}"

    # ------------------------------------------------------------------------------------------ ranks
    def data_parallel(self) -> tuple[int, int]:
        from megatron.core import parallel_state

        self._setup()
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def writes_outputs(self) -> bool:
        """Tensor-parallel rank 0 of the last pipeline stage, context-parallel rank 0: it holds whole logprobs."""
        from megatron.core import parallel_state

        self._setup()
        return (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.is_pipeline_last_stage()
        )

    # ------------------------------------------------------------------------------------------ state
    @property
    def hf_config(self) -> Any:
        """The model's Hugging Face config (``config.json`` of the reference policy; None before the first use)."""
        return self._hf_config

    @property
    def layout(self) -> Any:
        """The model's :class:`rl.backends.megatron.convert.LlamaLayout` (None before the first use)."""
        return self._layout

    @property
    def megatron_cfg(self) -> Any:
        """``policy.megatron_cfg`` of the run's config: the tensor, pipeline and context parallel split."""
        return self._mcfg

    def load_checkpoint(self, version: PolicyVersion, *, with_optimizer: bool) -> None:
        self._setup()
        super().load_checkpoint(version, with_optimizer=with_optimizer)

    def prepare_checkpoint(self, *, with_trainer_state: bool) -> None:
        """Gather the whole model (HF names) and, with ``with_trainer_state``, every shard's optimizer state onto rank 0
        (`rl.backends.megatron.model.gather_to_rank0`: host memory, replica 0's ranks only)."""

        hf = gather_hf_state_dict(self.model, self._layout, self._mcfg)
        optim = None
        if with_trainer_state:
            if self._optimizer is None:
                msg = (
                    "prepare_checkpoint(with_trainer_state=True): the megatron policy holds no optimizer state; "
                    "load it with load_checkpoint(version, with_optimizer=True)"
                )
                raise RuntimeError(msg)
            parts = gather_to_rank0((self._shard, _to_cpu(self._optimizer.state_dict())))
            optim = dict(parts) if parts is not None else None
        self._gathered = (self._version, hf, optim) if hf is not None else None  # type: ignore[assignment]

    def _whole(self, *, with_trainer_state: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Rank 0's gathered weights (and optimizer shards) of the held version; gathered now in a one-rank task.

        Raises:
            RuntimeError: several ranks and :meth:`prepare_checkpoint` was not called on all of them for this version.
        """

        stale = (
            self._gathered is None
            or self._gathered[0] != self._version
            or (with_trainer_state and self._gathered[2] is None)
        )
        if stale and dist.get_world_size() == 1:
            self.prepare_checkpoint(with_trainer_state=with_trainer_state)
        elif stale:
            msg = (
                f"the megatron policy is split over {dist.get_world_size()} ranks: call "
                f"prepare_checkpoint(with_trainer_state={with_trainer_state}) on every rank after training, "
                "before rank 0 saves or hands out weights"
            )
            raise RuntimeError(msg)
        assert self._gathered is not None
        return self._gathered[1], self._gathered[2]

    def save_checkpoint(self, url: str, *, trainer_state: Any | None = None, serving_dtype: str | None = None) -> str:
        with_state = trainer_state is not None
        weights, optim = self._whole(with_trainer_state=with_state)
        return checkpoint.save(
            url,
            model=HFFolder(self._hf_config, weights),
            tokenizer=self._tokenizer,
            optimizer=checkpoint.ShardedOptimizerState(optim) if with_state and optim else None,
            scheduler=self._scheduler if with_state else None,
            state=trainer_state,
            storage_options=self._cfg.dataplane.storage_options,
            serving_dtype=serving_dtype,
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        weights, _ = self._whole(with_trainer_state=False)
        out = dict(weights)
        if self._layout.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out.items()

    # ------------------------------------------------------------------------------------ forward passes
    def micro_batches(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None, *, train: bool
    ) -> list[slice]:
        """The micro-batches of ``batch`` (`rl.backends.micro_batch.micro_batch_slices`): ``micro_batch_size`` rows
        each when given; else the config's limits (`rl.backends.micro_batch.micro_batch_limits`, ``train`` or logprob
        ones). Under pipeline parallelism every micro-batch has the same row count (the stages exchange fixed shapes):
        no token budget."""

        rows, tokens = micro_batch_limits(self._cfg, self._hf_config, self.device, train=train)
        if micro_batch_size is not None:
            rows, tokens = micro_batch_size, None
        if self._mcfg.pipeline_model_parallel_size > 1:
            rows, tokens = rows or CPU_MICRO_BATCH_ROWS, None
        return micro_batch_slices(batch[F.INPUT_LENGTHS], max_rows=rows, max_tokens=tokens)

    def run_micro_batches(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        slices: Sequence[slice],
        on_logits: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]],
        *,
        forward_only: bool,
        every_position: bool = False,
    ) -> list[dict[str, Any]]:
        """Micro-batches ``batch[s]`` (``s`` in ``slices``) through megatron-core's schedule; ``on_logits(logits, mb)``
        runs on the last stage with this rank's logits and returns ``(loss, outputs)``: [m, s, V_pad/t] float32 with
        ``every_position``, else [1, T, V_pad/t] of the T positions that predict a wanted token (``mb["wanted_b"]``,
        ``mb["wanted_s"]``; :meth:`token_logprobs` reads either). Returns the outputs of every micro-batch in order
        (last stage only; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro = _micro_batches(batch, slices, self._mcfg)
        if not micro:
            return []
        device = self.device
        head = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None

        def step(data_iterator: Any, module: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
            if head is not None:
                head.wanted = None if every_position else (mb["wanted_s"], mb["wanted_b"])
            with autocast(model, self._cfg.model.precision):
                logits = module(mb["input_ids"], mb["position_ids"], None)  # on the last stage: see above
            if head is not None:
                mb["selected"] = not every_position and not self._mcfg.sequence_parallel
                head.wanted = None

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                loss, outputs = on_logits(output, mb)
                return loss, torch.ones((), dtype=torch.int, device=device), outputs

            return logits, loss_func

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=max(int(m["full_length"]) for m in micro),
            micro_batch_size=max(int(m["input_ids"].shape[0]) for m in micro),
            forward_only=forward_only,
        )

    def _logprobs(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None
    ) -> torch.Tensor:
        def on_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            lp = self.token_logprobs(logits, mb)  # [m, s]
            return lp.sum() * 0, {"logprobs": lp.detach()}

        with torch.no_grad():
            outs = self.run_micro_batches(
                model, batch, self.micro_batches(batch, micro_batch_size, train=False), on_logits, forward_only=True
            )
        return self.assemble_logprobs(batch, [o["logprobs"] for o in outs])

    def token_logprobs(self, logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """[m, s] float32 logprobs of ``mb["targets"]`` (prediction-aligned), 0 where not wanted, from the head's
        output: [1, T, V_pad/t] on the wanted positions (``mb["selected"]``) or [m, s, V_pad/t] on all."""

        vocab, temperature = self._layout.vocab_size, self._cfg.generation.temperature
        if not mb.get("selected"):
            return vocab_parallel_token_logprobs(
                logits, mb["targets"], vocab_size=vocab, temperature=temperature
            )  # [m, s]
        b, s = mb["wanted_b"], mb["wanted_s"]
        lp = vocab_parallel_token_logprobs(
            logits[0], mb["targets"][b, s], vocab_size=vocab, temperature=temperature
        )  # [T]
        return lp.new_zeros(mb["targets"].shape).index_put((b, s), lp)  # [m, s]

    def assemble_logprobs(self, batch: Mapping[str, torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
        """[N, S] logprobs aligned with ``input_ids``, 0 outside ``token_mask``, from the micro-batches'
        prediction-aligned context-parallel parts (:func:`_place`). Zeros on ranks that hold no logprobs (not the last
        stage)."""
        ids = batch[F.INPUT_IDS]
        n, s = ids.shape
        out = torch.zeros(n, s, dtype=torch.float32)
        if parts:
            out[:, 1:] = _place(parts, n, s - 1).float()
        return out * batch[F.TOKEN_MASK].bool()

    def load_reference_policy(self) -> None:
        if self._reference is None:
            self._setup()
            self._reference = self._build(self._reference_path)
            self._reference.requires_grad_(False)

    def get_topk_logits(
        self, batch: Mapping[str, torch.Tensor], k: int, *, micro_batch_size: int | None = None
    ) -> TopkLogits:
        """Top-k of the raw logits (no temperature) at every position that predicts a real token, over the whole
        vocabulary (each tensor-parallel rank's top-k, then the top-k of those)."""

        vocab = self._layout.vocab_size
        if not 1 <= k <= vocab:
            msg = f"get_topk_logits: k={k} must be between 1 and the vocabulary size {vocab}"
            raise ValueError(msg)

        def on_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            m, s, _ = logits.shape
            values, indices = vocab_parallel_topk(logits.reshape(m * s, -1), k, vocab_size=vocab)  # [m*s, k] each
            return logits.sum() * 0, {"values": values.reshape(m, s, k), "indices": indices.reshape(m, s, k)}

        ids, lengths = batch[F.INPUT_IDS], batch[F.INPUT_LENGTHS]
        n, s = ids.shape
        values = torch.zeros(n, max(s - 1, 0), k)  # [N, S-1, k]
        indices = torch.zeros(n, max(s - 1, 0), k, dtype=torch.int64)
        with torch.no_grad():
            slices = self.micro_batches(batch, micro_batch_size or self._cfg.optim.logprob_batch_size or 8, train=False)
            outs = self.run_micro_batches(self.model, batch, slices, on_logits, forward_only=True, every_position=True)
        if outs:
            live = (torch.arange(max(s - 1, 0))[None, :] < (lengths[:, None] - 1))[..., None]  # [N, S-1, 1]
            values = _place([o["values"] for o in outs], n, s - 1).float() * live
            indices = _place([o["indices"] for o in outs], n, s - 1) * live
        return TopkLogits(topk_logits=values, topk_indices=indices)

    # ------------------------------------------------------------------------------------------ training
    def _update(self, batch: Mapping[str, torch.Tensor], update_sizes: Sequence[int] | None) -> dict[str, float]:
        """The shared update (`rl.backends.engine.TrainEngine.train_batch`: same arguments, metrics and errors as the
        transformers back-end's) on megatron-core's model (`rl.backends.megatron.train.MegatronTrainEngine`)."""

        assert self._optimizer is not None
        return MegatronTrainEngine(self).train_batch(
            self._optimizer, self._scheduler, batch, self._cfg, update_sizes=update_sizes
        )


def _micro_batches(
    batch: Mapping[str, torch.Tensor], slices: Sequence[slice], mcfg: Any
) -> list[dict[str, torch.Tensor]]:
    """The rows ``batch[s]`` (``s`` in ``slices``) as micro-batches for megatron-core's schedule, on the CPU.

    Per-token fields become prediction-aligned (entry p belongs to the token at p + 1: ``targets`` are the next tokens,
    ``token_mask`` and the logprob fields are shifted likewise), padded to a length the context- and sequence-parallel
    split allows, and split to this context-parallel rank's positions (``position_ids`` say which). Under pipeline
    parallelism every micro-batch has the same shape (the stages exchange fixed-size activations): the largest
    slice's rows (padding rows have an empty mask) of the batch's longest length; otherwise each is cut to its own
    longest row. ``wanted_b``, ``wanted_s`` ([T] int64 each) are the (row, position) of this rank's wanted
    prediction-aligned positions (``token_mask``), where the LM head runs (`rl.backends.megatron.model`).
    """
    from megatron.core import parallel_state

    lengths = batch[F.INPUT_LENGTHS]
    n = lengths.shape[0]
    cp, cp_rank = mcfg.context_parallel_size, parallel_state.get_context_parallel_rank()
    fixed = mcfg.pipeline_model_parallel_size > 1

    def pad_to(length: int) -> int:
        return padded_length(
            length,
            context_parallel_size=cp,
            tensor_parallel_size=mcfg.tensor_model_parallel_size,
            sequence_parallel=mcfg.sequence_parallel,
        )

    whole = pad_to(int(lengths.max())) if n else 0
    size = max((r.stop - r.start for r in slices), default=0)
    out = []
    for rows in slices:
        width = whole if fixed else pad_to(int(lengths[rows].max()))
        m = size if fixed else rows.stop - rows.start

        def fit(x: torch.Tensor) -> torch.Tensor:  # [r, <= width] -> [m, width], zero-padded
            return torch.nn.functional.pad(x, (0, width - x.shape[1], 0, m - x.shape[0]))  # noqa: B023

        mb: dict[str, torch.Tensor] = {}
        for key, value in batch.items():
            v = value[rows]
            if v.dim() == 1:  # per row: [r] -> [m]
                mb[key] = torch.nn.functional.pad(v, (0, m - v.shape[0]))
                continue
            if key == F.INPUT_IDS:
                mb[key] = fit(v[:, :width])  # the model's inputs
            mb["targets" if key == F.INPUT_IDS else key] = fit(v[:, 1 : width + 1])  # per token: prediction-aligned
        positions = torch.arange(width).expand(m, width)
        for key in [k for k, v in mb.items() if v.dim() == 2]:
            mb[key] = context_parallel_split(mb[key], rank=cp_rank, size=cp)
        mb["position_ids"] = context_parallel_split(positions, rank=cp_rank, size=cp)
        mb["full_length"] = torch.tensor(width)
        if F.TOKEN_MASK in mb:
            mb["wanted_b"], mb["wanted_s"] = mb[F.TOKEN_MASK].bool().nonzero(as_tuple=True)  # host: no device sync
        else:
            mb["wanted_b"] = mb["wanted_s"] = torch.zeros(0, dtype=torch.int64)
        out.append(mb)
    return out


def _gather_context_parallel(x: torch.Tensor) -> torch.Tensor:
    """[m, S/c, ...] of this context-parallel rank -> [m, S, ...] of the whole sequence (all-gathered over the
    group)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=parallel_state.get_context_parallel_group())
    return context_parallel_merge(parts)


def _place(parts: list[torch.Tensor], n: int, width: int) -> torch.Tensor:
    """[n, width, ...] on the CPU from the micro-batches' [m, s, ...] context-parallel parts, in order: each part is
    all-gathered over the context-parallel ranks (a collective: all of them call this), then its rows and positions that
    fall inside ``n`` x ``width`` are kept (micro-batches may be padded past both)."""
    out: torch.Tensor | None = None
    row = 0
    for part in parts:
        whole = _gather_context_parallel(part).cpu()  # [m, S', ...]
        if out is None:
            out = whole.new_zeros(n, width, *whole.shape[2:])
        m, w = min(whole.shape[0], n - row), min(whole.shape[1], width)
        if m > 0:
            out[row : row + m, :w] = whole[:m, :w]
        row += whole.shape[0]
    assert out is not None
    return out


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside (dicts, lists, tuples) moved to the CPU, for ``gather_object``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
