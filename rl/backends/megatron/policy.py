"""The Megatron-core policy back-end: megatron-core's GPT model built from our HF checkpoint, split over tensor,
pipeline and context parallel ranks (``policy.megatron_cfg``), behind :class:`rl.backends.interfaces.PolicyBackend`.

What is shared with the transformers back-end: the loss (`rl.loss.clipped_pg_loss`, normalized by the global token
and sequence counts), AdamW with its warmup (`rl.backends.hf.train.make_optimizer`), the step metrics and the
checkpoint format: every checkpoint is an HF folder (`rl.backends.megatron.model.HFFolder`), so validation, MLflow and
vLLM refits read the same files whatever trained them.

How it runs (Megatron-LM's training loop, reduced to what GRPO needs):
- micro-batches go through megatron-core's pipeline schedule (``get_forward_backward_func``); its loss function runs
  on the last stage, on this context-parallel rank's part of each sequence (`rl.backends.megatron.parallel`), with
  token logprobs over the vocabulary split across tensor-parallel ranks (``vocab_parallel_cross_entropy``);
- parameters are float32 and forward passes run under ``torch.autocast`` in ``model.precision`` (as in the
  transformers back-end), so checkpoints hold the float32 master weights exactly; the LM head runs in float32
  (`rl.backends.megatron.model.float32_lm_head`);
- after the last micro-batch of an update the gradients are summed over the data- and context-parallel ranks
  (`rl.distributed.all_reduce_gradients`), the tied embedding's over the first and last pipeline stages and the
  sequence-parallel layernorms' over the tensor-parallel ranks (megatron-core's ``finalize_model_grads`` does the
  same for its DDP wrapper); the norm is megatron-core's model-parallel one (``get_grad_norm_fp32``), the clipping torch's.

Deviation from NeMo-RL's Megatron worker: bf16 compute under autocast with float32 parameters and torch's AdamW instead
of megatron-core's bf16 parameters with float32 master copies in its optimizer (more memory, exact checkpoints).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from dataplane import fields as F
from rl.backends.interfaces import PolicyBackend, PolicyVersion, TopkLogits
from rl.config import GRPOConfig


class MegatronPolicy(PolicyBackend):
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
        self._cfg = cfg
        self._mcfg = cfg.policy.megatron_cfg
        self._tokenizer = tokenizer
        self._reference_path = reference_path
        self._hf_config: Any = None
        self._layout: Any = None
        self._model: torch.nn.Module | None = None
        self._reference: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._version: int | None = None
        self._optimizer_version: int | None = None
        self._gathered: tuple[int, dict[str, torch.Tensor], dict[str, Any] | None] | None = None

    # ------------------------------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Once per process: check megatron-core and CUDA, read the architecture, split the ranks into groups."""
        if self._layout is not None:
            return
        from transformers import AutoConfig

        from rl.backends.megatron.convert import LlamaLayout
        from rl.backends.megatron.model import init_model_parallel

        self._check_installed()
        self._hf_config = AutoConfig.from_pretrained(self._reference_path)
        self._layout = LlamaLayout.from_hf_config(self._hf_config)
        init_model_parallel(self._mcfg, seed=self._cfg.grpo.seed)

    def _check_installed(self) -> None:
        """Raise, saying what to install or where to run, without megatron-core or a CUDA GPU."""
        from rl.backends import registry

        registry.check_installed("policy", self.name)

    def _build(self, path: str) -> torch.nn.Module:
        """This rank's shard of the model with the weights of the HF folder at ``path`` (local)."""
        from transformers import AutoModelForCausalLM

        from rl.backends.megatron.model import build_gpt_model, load_hf_state_dict

        from rl.precision import resolve

        bf16 = resolve(self._cfg.model.precision, self._device) == "bfloat16"
        model = build_gpt_model(self._layout, self._hf_config, self._mcfg, device=self._device, compute_dtype=torch.bfloat16 if bf16 else torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        load_hf_state_dict(model, hf, self._layout, self._mcfg)
        return model

    @property
    def _device(self) -> torch.device:
        """This rank's GPU (``LOCAL_RANK``'s, set by ``rl.distributed.process_group``)."""
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def _shard(self) -> str:
        """This rank's model-parallel shard, the name of its optimizer state in a checkpoint."""
        from megatron.core import parallel_state

        return f"megatron-tp{parallel_state.get_tensor_model_parallel_rank()}-pp{parallel_state.get_pipeline_model_parallel_rank()}"

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
    def weight_version(self) -> int | None:
        return self._version

    @property
    def pad_token_id(self) -> int:
        return int(self._tokenizer.pad_token_id)

    @property
    def model(self) -> torch.nn.Module:
        """This rank's shard of the policy.

        Raises:
            RuntimeError: no weights loaded yet.
        """
        if self._model is None:
            msg = "the megatron policy holds no weights yet: call load_checkpoint(version) first"
            raise RuntimeError(msg)
        return self._model

    def has_optimizer_state(self, version: PolicyVersion) -> bool:
        return self._optimizer is not None and self._version == version.step and self._optimizer_version == version.step

    def load_checkpoint(self, version: PolicyVersion, *, with_optimizer: bool) -> None:
        from rl import checkpoint
        from rl.backends.hf.train import make_optimizer

        self._setup()
        so = self._cfg.dataplane.storage_options
        if with_optimizer:
            checkpoint.require_trainer_state(version.path, version.step, so)
        with checkpoint.local_folder(version.path, so, require_complete=version.step > 0) as folder:
            if self._model is None or self._version != version.step:
                self._model = self._build(folder)
                self._optimizer = self._scheduler = self._optimizer_version = self._gathered = None
                self._version = version.step
            if with_optimizer:
                self._optimizer, self._scheduler = make_optimizer(self._model, self._cfg)
                if version.step != 0:
                    checkpoint.load_trainer_state(folder, self._optimizer, self._scheduler, shard=self._shard)
                self._optimizer_version = version.step

    def prepare_checkpoint(self, *, with_trainer_state: bool) -> None:
        """Gather the whole model (HF names) and, with ``with_trainer_state``, every shard's optimizer state onto rank 0
        (`rl.backends.megatron.model.gather_to_rank0`: host memory, replica 0's ranks only)."""
        from rl.backends.megatron.model import gather_hf_state_dict, gather_to_rank0

        hf = gather_hf_state_dict(self.model, self._layout, self._mcfg)
        optim = None
        if with_trainer_state:
            if self._optimizer is None:
                msg = "prepare_checkpoint(with_trainer_state=True): the megatron policy holds no optimizer state; load it with load_checkpoint(version, with_optimizer=True)"
                raise RuntimeError(msg)
            parts = gather_to_rank0((self._shard, _to_cpu(self._optimizer.state_dict())))
            optim = dict(parts) if parts is not None else None
        self._gathered = (self._version, hf, optim) if hf is not None else None  # type: ignore[assignment]

    def _whole(self, *, with_trainer_state: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Rank 0's gathered weights (and optimizer shards) of the held version; gathered now in a one-rank task.

        Raises:
            RuntimeError: several ranks and :meth:`prepare_checkpoint` was not called on all of them for this version.
        """
        import torch.distributed as dist

        stale = self._gathered is None or self._gathered[0] != self._version or (with_trainer_state and self._gathered[2] is None)
        if stale and dist.get_world_size() == 1:
            self.prepare_checkpoint(with_trainer_state=with_trainer_state)
        elif stale:
            msg = (
                f"the megatron policy is split over {dist.get_world_size()} ranks: call prepare_checkpoint(with_trainer_state="
                f"{with_trainer_state}) on every rank after training, before rank 0 saves or hands out weights"
            )
            raise RuntimeError(msg)
        assert self._gathered is not None
        return self._gathered[1], self._gathered[2]

    def save_checkpoint(self, url: str, *, trainer_state: Any | None = None) -> str:
        from rl import checkpoint
        from rl.backends.megatron.model import HFFolder

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
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        weights, _ = self._whole(with_trainer_state=False)
        out = dict(weights)
        if self._layout.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out.items()

    # ------------------------------------------------------------------------------------ forward passes
    def _run(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        micro_batch_size: int,
        on_logits: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]],
        *,
        forward_only: bool,
    ) -> list[dict[str, Any]]:
        """Micro-batches of ``batch`` through megatron-core's schedule; ``on_logits(logits, mb)`` runs on the last
        stage with this rank's [m, s, V_pad/t] logits and returns ``(loss, outputs)``. Returns the outputs of every
        micro-batch in order (last stage only; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from rl.precision import autocast

        micro = _micro_batches(batch, micro_batch_size, self._mcfg)
        if not micro:
            return []
        device = self._device

        def step(data_iterator: Any, module: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
            with autocast(model, self._cfg.model.precision):
                logits = module(mb["input_ids"], mb["position_ids"], None)  # [m, s, V_pad/t] on the last stage

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                loss, outputs = on_logits(output, mb)
                return loss, torch.ones((), dtype=torch.int, device=device), outputs

            return logits, loss_func

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=int(micro[0]["full_length"]),
            micro_batch_size=int(micro[0]["input_ids"].shape[0]),
            forward_only=forward_only,
        )

    def _logprobs(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None) -> torch.Tensor:
        from rl.backends.megatron.parallel import vocab_parallel_token_logprobs

        vocab, temperature = self._layout.vocab_size, self._cfg.generation.temperature

        def on_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            lp = vocab_parallel_token_logprobs(logits, mb["targets"], vocab_size=vocab, temperature=temperature)  # [m, s]
            return lp.sum() * 0, {"logprobs": lp.detach()}

        with torch.no_grad():
            outs = self._run(model, batch, micro_batch_size or self._cfg.optim.logprob_batch_size, on_logits, forward_only=True)
        return self._assemble(batch, [o["logprobs"] for o in outs])

    def _assemble(self, batch: Mapping[str, torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
        """[N, S] logprobs aligned with ``input_ids``, 0 outside ``token_mask``, from the micro-batches' prediction-aligned
        context-parallel parts (:func:`_place`). Zeros on ranks that hold no logprobs (not the last stage)."""
        ids = batch[F.INPUT_IDS]
        n, s = ids.shape
        out = torch.zeros(n, s, dtype=torch.float32)
        if parts:
            out[:, 1:] = _place(parts, n, s - 1).float()
        return out * batch[F.TOKEN_MASK].bool()

    def get_logprobs(self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None) -> torch.Tensor:
        return self._logprobs(self.model, batch, micro_batch_size)

    def load_reference_policy(self) -> None:
        if self._reference is None:
            self._setup()
            self._reference = self._build(self._reference_path)
            self._reference.requires_grad_(False)

    def get_reference_policy_logprobs(self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None) -> torch.Tensor:
        self.load_reference_policy()
        assert self._reference is not None
        return self._logprobs(self._reference, batch, micro_batch_size)

    def get_topk_logits(self, batch: Mapping[str, torch.Tensor], k: int, *, micro_batch_size: int | None = None) -> TopkLogits:
        """Top-k of the raw logits (no temperature) at every position that predicts a real token, over the whole
        vocabulary (each tensor-parallel rank's top-k, then the top-k of those)."""
        from rl.backends.megatron.parallel import vocab_parallel_topk

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
            outs = self._run(self.model, batch, micro_batch_size or self._cfg.optim.logprob_batch_size, on_logits, forward_only=True)
        if outs:
            live = (torch.arange(max(s - 1, 0))[None, :] < (lengths[:, None] - 1))[..., None]  # [N, S-1, 1]
            values = _place([o["values"] for o in outs], n, s - 1).float() * live
            indices = _place([o["indices"] for o in outs], n, s - 1) * live
        return TopkLogits(topk_logits=values, topk_indices=indices)

    # ------------------------------------------------------------------------------------------ training
    def prepare_for_training(self) -> None:
        if self._optimizer is None or self._optimizer_version != self._version:
            msg = "prepare_for_training: no optimizer state for the held weights; call load_checkpoint(version, with_optimizer=True)"
            raise RuntimeError(msg)
        self.model.train()

    def finish_training(self) -> None:
        if self._model is not None:
            self._model.eval()
            self._model.zero_grad(set_to_none=True)

    def train(self, batch: Mapping[str, torch.Tensor], *, update_sizes: Sequence[int] | None = None) -> dict[str, float]:
        if self._optimizer is None or self._optimizer_version != self._version:
            msg = "train: no optimizer state for the held weights; call load_checkpoint(version, with_optimizer=True)"
            raise RuntimeError(msg)
        assert self._version is not None
        try:
            metrics = self._train(batch, update_sizes)
        except BaseException:
            # the weights may be half-updated: drop them, so nothing uses them as any version
            self._model = self._optimizer = self._scheduler = self._version = self._optimizer_version = self._gathered = None
            raise
        self._version += 1
        self._optimizer_version = self._version
        return metrics

    def _train(self, batch: Mapping[str, torch.Tensor], update_sizes: Sequence[int] | None) -> dict[str, float]:
        """The transformers back-end's ``train_on_batch`` (same arguments, metrics and errors) on megatron-core's model."""
        from megatron.core import parallel_state

        from rl import distributed
        from rl.backends.hf.train import combine_step_metrics, step_batch
        from rl.filters import seq_mult_prob_error
        from rl.loss import accumulate, loss_mask

        cfg, model, optimizer = self._cfg, self.model, self._optimizer
        assert optimizer is not None
        td, update_sizes = step_batch(batch, cfg, update_sizes)
        n = int(td.batch_size[0])
        threshold = cfg.loss.seq_logprob_error_threshold
        reports = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
        first_cp = parallel_state.get_context_parallel_rank() == 0
        dp_group = parallel_state.get_data_parallel_group()
        totals: dict[str, float] = {}
        losses, norms, seq_errors = [], [], []
        model.train()
        for rows in td.split(list(update_sizes)):
            mask = loss_mask(rows[F.TOKEN_MASK], rows[F.SAMPLE_MASK])
            counts = distributed.all_reduce(torch.stack([mask.sum().double(), rows[F.SAMPLE_MASK].double().sum()]), group=dp_group)  # [2]
            global_toks, global_seqs = float(counts[0].clamp(min=1)), float(counts[1].clamp(min=1))
            optimizer.zero_grad(set_to_none=True)
            on_logits = functools.partial(self._loss_on_logits, global_toks=global_toks, global_seqs=global_seqs)
            outs = self._run(model, rows, cfg.optim.train_micro_batch_size, on_logits, forward_only=False) if rows.batch_size[0] else []
            step_loss = 0.0
            for o in outs if reports else ():
                step_loss += float(o["loss"])
                for k, v in o["sums"].items():
                    accumulate(totals, {k: v})
            if reports and rows.batch_size[0]:  # every context-parallel rank: _assemble gathers over them
                prev = rows[F.PREV_LOGPROBS] if F.PREV_LOGPROBS in rows.keys() else self._assemble(rows, [o["logprobs"] for o in outs])
                if first_cp:
                    errors = seq_mult_prob_error(rows[F.GENERATION_LOGPROBS], prev, rows[F.TOKEN_MASK])  # [m]
                    seq_errors.append(errors[rows[F.SAMPLE_MASK].bool()])
            norms.append(self._finish_gradients())
            optimizer.step()
            self._scheduler.step()
            losses.append(step_loss)
        model.eval()
        optimizer.zero_grad(set_to_none=True)
        masked = n - int(td[F.SAMPLE_MASK].bool().sum()) if reports and first_cp else 0
        local = (totals, losses, torch.cat(seq_errors) if seq_errors else torch.zeros(0), masked) if reports else None
        parts = [p for p in distributed.gather_objects(local) if p is not None]  # one per (replica, context-parallel rank)
        metrics = combine_step_metrics(parts, masking=threshold is not None)
        metrics.update(grad_norm=sum(norms) / len(norms), lr=float(self._scheduler.get_last_lr()[0]))
        return metrics

    def _loss_on_logits(
        self, logits: torch.Tensor, mb: dict[str, torch.Tensor], *, global_toks: float, global_seqs: float
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The GRPO loss of one micro-batch on this context-parallel rank's positions (`rl.loss.clipped_pg_loss_with`).

        ``mb``'s per-token fields are prediction-aligned and split (:func:`_micro_batches`); a zero column in front
        makes them the token-aligned [m, 1 + s] tensors the loss expects (it drops position 0).
        """
        from rl.backends.megatron.parallel import vocab_parallel_token_logprobs
        from rl.loss import LossInputs, clipped_pg_loss_with

        cfg = self._cfg
        lp = vocab_parallel_token_logprobs(logits, mb["targets"], vocab_size=self._layout.vocab_size, temperature=cfg.generation.temperature)  # [m, s]

        def aligned(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_zeros(x.shape[0], 1), x], 1)  # [m, 1 + s]

        curr = aligned(lp)
        prev = aligned(mb[F.PREV_LOGPROBS].float()) if F.PREV_LOGPROBS in mb else curr.detach()
        inputs = LossInputs(
            logprobs=curr,
            prev_logprobs=prev,
            reference_policy_logprobs=aligned(mb[F.REFERENCE_POLICY_LOGPROBS].float()),
            generation_logprobs=aligned(mb[F.GENERATION_LOGPROBS].float()),
            advantages=aligned(mb[F.ADVANTAGES].float()),
            token_mask=aligned(mb[F.TOKEN_MASK]).bool(),
            sample_mask=mb[F.SAMPLE_MASK],
        )
        loss, sums = clipped_pg_loss_with(inputs, cfg.loss, global_valid_toks=global_toks, global_valid_seqs=global_seqs)
        return loss, {"loss": loss.detach(), "sums": {k: v.detach() for k, v in sums.items()}, "logprobs": lp.detach()}

    def _finish_gradients(self) -> float:
        """After an update's last micro-batch: sum the gradients over the replicas and context-parallel ranks, the tied
        embedding's over the first and last stages, sequence-parallel layernorms' over the tensor-parallel ranks; clip
        to ``optim.max_grad_norm`` by the model-parallel norm (megatron-core's ``get_grad_norm_fp32``). Returns the
        norm before clipping."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        from rl import distributed

        model = self.model
        params = [p for p in model.parameters() if p.requires_grad]
        distributed.all_reduce_gradients(params, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        untouched = [p for p in params if p.grad is None]  # no replica gave them a gradient
        for p in untouched:
            p.grad = torch.zeros_like(p)  # every rank takes part in the collectives below
        if self._layout.tie_word_embeddings and self._mcfg.pipeline_model_parallel_size > 1 and parallel_state.is_rank_in_embedding_group():
            shared = model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=parallel_state.get_embedding_group())
        if self._mcfg.sequence_parallel:
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
        for p in untouched:  # still none from another stage or rank: AdamW skips them, as in the transformers back-end
            if not bool(p.grad.any()):  # type: ignore[union-attr]
                p.grad = None
        params = [p for p in params if p.grad is not None]
        counted = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        norm = float(get_grad_norm_fp32(counted, grad_stats_parallel_group=parallel_state.get_model_parallel_group()))
        if self._cfg.optim.max_grad_norm > 0:  # torch's clip_grad_norm_ with that norm: scale by max / (norm + 1e-6) if < 1
            scale = self._cfg.optim.max_grad_norm / (norm + 1e-6)
            if scale < 1:
                torch._foreach_mul_([p.grad for p in params], scale)
        return norm

    def shutdown(self) -> bool:
        self._model = self._reference = self._optimizer = self._scheduler = self._gathered = None
        self._version = self._optimizer_version = None
        return True


def _micro_batches(batch: Mapping[str, torch.Tensor], size: int, mcfg: Any) -> list[dict[str, torch.Tensor]]:
    """The rows of ``batch`` as micro-batches of ``size`` rows for megatron-core's schedule, on the CPU.

    Per-token fields become prediction-aligned (entry p belongs to the token at p + 1: ``targets`` are the next tokens,
    ``token_mask`` and the logprob fields are shifted likewise), padded to a length the context- and sequence-parallel
    split allows, and split to this context-parallel rank's positions (``position_ids`` say which). Under pipeline
    parallelism every micro-batch has the same shape (the stages exchange fixed-size activations): ``size`` rows
    (padding rows have an empty mask) of the batch's longest length; otherwise each is cut to its own longest row.
    """
    from megatron.core import parallel_state

    from rl.backends.megatron.parallel import context_parallel_split, padded_length

    lengths = batch[F.INPUT_LENGTHS]
    n = lengths.shape[0]
    cp, cp_rank = mcfg.context_parallel_size, parallel_state.get_context_parallel_rank()
    fixed = mcfg.pipeline_model_parallel_size > 1

    def pad_to(length: int) -> int:
        return padded_length(length, context_parallel_size=cp, tensor_parallel_size=mcfg.tensor_model_parallel_size, sequence_parallel=mcfg.sequence_parallel)

    whole = pad_to(int(lengths.max())) if n else 0
    out = []
    for a in range(0, n, size):
        rows = slice(a, min(a + size, n))
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
        out.append(mb)
    return out


def _gather_context_parallel(x: torch.Tensor) -> torch.Tensor:
    """[m, S/c, ...] of this context-parallel rank -> [m, S, ...] of the whole sequence (all-gathered over the group)."""
    from megatron.core import parallel_state

    from rl.backends.megatron.parallel import context_parallel_merge

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
