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
  transformers back-end), so checkpoints hold the float32 master weights exactly; the LM head runs only on the
  positions that predict a wanted token, in the compute dtype with float32 logits
  (`rl.backends.megatron.model.selective_lm_head`);
- the update's loop, loss, optimizer and metrics are the shared engine's (`rl.backends.engine`); this back-end gives
  it the forward and backward of micro-batches and its gradient reduction (:class:`MegatronTrainEngine`);
- after the last micro-batch of an update the gradients are summed over the data- and context-parallel ranks
  (`rl.distributed.all_reduce_gradients`), the tied embedding's over the first and last pipeline stages and the
  sequence-parallel layernorms' over the tensor-parallel ranks (megatron-core's ``finalize_model_grads`` does the
  same for its DDP wrapper); the norm is megatron-core's model-parallel one (``get_grad_norm_fp32``), the clipping torch's.

Deviation from NeMo-RL's Megatron worker: bf16 compute under autocast with float32 parameters and torch's AdamW instead
of megatron-core's bf16 parameters with float32 master copies in its optimizer (more memory, exact checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from dataplane import fields as F
from rl.backends.engine import LossFn, MicroBatchLoss, TrainEngine
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
        model = build_gpt_model(
            self._layout,
            self._hf_config,
            self._mcfg,
            device=self._device,
            compute_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        from rl.model import model_construction

        with model_construction():  # transformers' loading switches process-wide state (rl.model.model_construction)
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
        from rl.backends.engine import make_optimizer

        self._setup()
        so = self._cfg.dataplane.storage_options
        if with_optimizer:
            checkpoint.require_trainer_state(version.path, version.step, so)
        with checkpoint.local_folder(
            version.path, so, require_complete=version.step > 0, weights_only=not with_optimizer
        ) as folder:
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

        stale = (
            self._gathered is None
            or self._gathered[0] != self._version
            or (with_trainer_state and self._gathered[2] is None)
        )
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

    def save_checkpoint(self, url: str, *, trainer_state: Any | None = None, serving_dtype: str | None = None) -> str:
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
            serving_dtype=serving_dtype,
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        weights, _ = self._whole(with_trainer_state=False)
        out = dict(weights)
        if self._layout.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out.items()

    # ------------------------------------------------------------------------------------ forward passes
    def _slices(self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None, *, train: bool) -> list[slice]:
        """The micro-batches of ``batch`` (`rl.backends.engine.micro_batch_slices`): ``micro_batch_size`` rows each
        when given; else the config's limits (`rl.backends.engine.micro_batch_limits`). Under pipeline parallelism
        every micro-batch has the same row count (the stages exchange fixed shapes): no token budget."""
        from rl.backends.engine import CPU_MICRO_BATCH_ROWS, micro_batch_limits, micro_batch_slices

        rows, tokens = micro_batch_limits(self._cfg, self._hf_config, self._device, train=train)
        if micro_batch_size is not None:
            rows, tokens = micro_batch_size, None
        if self._mcfg.pipeline_model_parallel_size > 1:
            rows, tokens = rows or CPU_MICRO_BATCH_ROWS, None
        return micro_batch_slices(batch[F.INPUT_LENGTHS], max_rows=rows, max_tokens=tokens)

    def _run(
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
        ``mb["wanted_s"]``; :func:`_token_logprobs` reads either). Returns the outputs of every micro-batch in order
        (last stage only; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from rl.precision import autocast

        micro = _micro_batches(batch, slices, self._mcfg)
        if not micro:
            return []
        device = self._device
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
            lp = self._token_logprobs(logits, mb)  # [m, s]
            return lp.sum() * 0, {"logprobs": lp.detach()}

        with torch.no_grad():
            outs = self._run(
                model, batch, self._slices(batch, micro_batch_size, train=False), on_logits, forward_only=True
            )
        return self._assemble(batch, [o["logprobs"] for o in outs])

    def _token_logprobs(self, logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """[m, s] float32 logprobs of ``mb["targets"]`` (prediction-aligned), 0 where not wanted, from the head's
        output: [1, T, V_pad/t] on the wanted positions (``mb["selected"]``) or [m, s, V_pad/t] on all."""
        from rl.backends.megatron.parallel import vocab_parallel_token_logprobs

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

    def get_reference_policy_logprobs(
        self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        self.load_reference_policy()
        assert self._reference is not None
        return self._logprobs(self._reference, batch, micro_batch_size)

    def get_topk_logits(
        self, batch: Mapping[str, torch.Tensor], k: int, *, micro_batch_size: int | None = None
    ) -> TopkLogits:
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
            slices = self._slices(batch, micro_batch_size or self._cfg.optim.logprob_batch_size or 8, train=False)
            outs = self._run(self.model, batch, slices, on_logits, forward_only=True, every_position=True)
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

    def train(
        self, batch: Mapping[str, torch.Tensor], *, update_sizes: Sequence[int] | None = None
    ) -> dict[str, float]:
        if self._optimizer is None or self._optimizer_version != self._version:
            msg = "train: no optimizer state for the held weights; call load_checkpoint(version, with_optimizer=True)"
            raise RuntimeError(msg)
        assert self._version is not None
        try:
            metrics = self._train(batch, update_sizes)
        except BaseException:
            # the weights may be half-updated: drop them, so nothing uses them as any version
            self._model = self._optimizer = self._scheduler = self._version = self._optimizer_version = (
                self._gathered
            ) = None
            raise
        self._version += 1
        self._optimizer_version = self._version
        return metrics

    def _train(self, batch: Mapping[str, torch.Tensor], update_sizes: Sequence[int] | None) -> dict[str, float]:
        """The shared update (`rl.backends.engine.train_on_batch`: same arguments, metrics and errors as the
        transformers back-end's) on megatron-core's model."""
        from rl.backends.engine import train_on_batch

        assert self._optimizer is not None
        return train_on_batch(
            MegatronTrainEngine(self), self._optimizer, self._scheduler, batch, self._cfg, update_sizes=update_sizes
        )

    def _forward_backward(self, rows: Any, slices: Sequence[slice], loss_fn: Any) -> list[tuple[slice, Any]]:
        """:meth:`MegatronTrainEngine.forward_backward`: the micro-batches through megatron-core's schedule, the
        shared loss on the last stage on this context-parallel rank's positions. A zero column in front makes the
        prediction-aligned fields (:func:`_micro_batches`) the token-aligned [m, 1 + s] tensors the loss expects (it
        drops position 0)."""
        from megatron.core import parallel_state

        from rl.backends.engine import MicroBatchLoss
        from rl.filters import seq_mult_prob_error

        def aligned(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_zeros(x.shape[0], 1), x], 1)  # [m, 1 + s]

        def on_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            lp = self._token_logprobs(logits, mb)  # [m, s]
            fields = {
                k: aligned(mb[k].float())
                for k in (F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS, F.GENERATION_LOGPROBS, F.ADVANTAGES)
                if k in mb
            }
            fields[F.TOKEN_MASK] = aligned(mb[F.TOKEN_MASK]).bool()
            fields[F.SAMPLE_MASK] = mb[F.SAMPLE_MASK]
            result = loss_fn(aligned(lp), fields)
            return result.loss, {"result": result, "logprobs": lp.detach()}

        outs = self._run(self.model, rows, slices, on_logits, forward_only=False)
        if not outs:
            return []
        pairs = [(where, o["result"]) for where, o in zip(slices, outs, strict=True)]
        if parallel_state.get_context_parallel_world_size() > 1:  # each rank saw part of every row: whole-row errors
            prev = (
                rows[F.PREV_LOGPROBS]
                if F.PREV_LOGPROBS in rows.keys()
                else self._assemble(rows, [o["logprobs"] for o in outs])
            )
            errors = seq_mult_prob_error(rows[F.GENERATION_LOGPROBS], prev, rows[F.TOKEN_MASK]).to(self._device)  # [n]
            pairs = [(w, MicroBatchLoss(loss=r.loss, sums=r.sums, errors=errors[w])) for w, r in pairs]
        n = [w.stop - w.start for w, _ in pairs]
        return [
            (w, MicroBatchLoss(loss=r.loss, sums=r.sums, errors=r.errors[:k]))
            for (w, r), k in zip(pairs, n, strict=True)
        ]  # padding rows out

    def _finish_gradients(self, max_norm: float) -> torch.Tensor:
        """After an update's last micro-batch: sum the gradients over the replicas and context-parallel ranks, the tied
        embedding's over the first and last stages, sequence-parallel layernorms' over the tensor-parallel ranks; clip
        to ``max_norm`` (inf: no clipping) by the model-parallel norm (megatron-core's ``get_grad_norm_fp32``). Returns
        the norm before clipping (0-dim float64, host)."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        from rl import distributed

        model = self.model
        params = [p for p in model.parameters() if p.requires_grad]
        distributed.all_reduce_gradients(
            params, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        untouched = [p for p in params if p.grad is None]  # no replica gave them a gradient
        for p in untouched:
            p.grad = torch.zeros_like(p)  # every rank takes part in the collectives below
        if (
            self._layout.tie_word_embeddings
            and self._mcfg.pipeline_model_parallel_size > 1
            and parallel_state.is_rank_in_embedding_group()
        ):
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
        scale = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ with that norm: scale by max / (norm + 1e-6) if < 1
        if scale < 1:
            torch._foreach_mul_([p.grad for p in params], scale)
        return torch.tensor(norm, dtype=torch.float64)

    def shutdown(self) -> bool:
        self._model = self._reference = self._optimizer = self._scheduler = self._gathered = None
        self._version = self._optimizer_version = None
        return True


class MegatronTrainEngine(TrainEngine):
    """:class:`MegatronPolicy` as a :class:`rl.backends.engine.TrainEngine`: megatron-core's schedule runs the
    micro-batches; counts are summed over the data-parallel group; the last pipeline stage's first tensor-parallel
    rank reports the metrics, its first context-parallel rank the per-row ones."""

    def __init__(self, policy: MegatronPolicy) -> None:
        self.policy = policy
        self.device = policy._device

    @property
    def model_config(self) -> Any:
        return self.policy._hf_config

    def micro_batches(self, rows: Any, cfg: GRPOConfig) -> list[slice]:
        return self.policy._slices(rows, None, train=True)

    def forward_backward(
        self, rows: Any, slices: Sequence[slice], loss_fn: LossFn
    ) -> list[tuple[slice, MicroBatchLoss]]:
        return self.policy._forward_backward(rows, slices, loss_fn)

    def finish_gradients(self, max_norm: float) -> torch.Tensor:
        return self.policy._finish_gradients(max_norm)

    def reports(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0

    def reports_rows(self) -> bool:
        from megatron.core import parallel_state

        return self.reports() and parallel_state.get_context_parallel_rank() == 0

    def count_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def train_mode(self, on: bool) -> None:
        self.policy.model.train(on)


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

    from rl.backends.megatron.parallel import context_parallel_split, padded_length

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
