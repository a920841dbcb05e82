"""Megatron-core's GPT model for a Hugging Face Llama-family checkpoint: the process groups, the ``TransformerConfig``
read off the HF config, this rank's shard of the weights in, and the whole model's HF state dict back out.

The weight mapping itself is `rl.backends.megatron.convert`; the model-parallel maths `rl.backends.megatron.parallel`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl.backends.megatron.convert import (
    LlamaLayout,
    check_parallel_layout,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline_stages,
    merge_tensor_parallel,
    shard_tensor_parallel,
    split_pipeline_stage,
)
from rl.config import MegatronConfig


def has_transformer_engine() -> bool:
    """Whether Transformer Engine is installed: its fused layers then replace megatron-core's local ones."""
    return importlib.util.find_spec("transformer_engine") is not None


def init_model_parallel(mcfg: MegatronConfig, *, seed: int) -> None:
    """Join (or start) the process group and split it into megatron-core's tensor, pipeline, context and data
    parallel groups (``parallel_state.initialize_model_parallel``, order tp-cp-dp-pp); seed its CUDA RNG tracker.

    Without a process group (a task with one rank) a one-rank group is started on a free loopback port. Called again
    with the same sizes it does nothing.

    Raises:
        ValueError: the sizes differ from those the process already initialized, or do not divide the world.
        RuntimeError: CUDA ranks that joined over gloo (fewer GPUs than ranks on a node).
    """
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if torch.cuda.is_available() and dist.get_world_size() > 1 and str(dist.get_backend()) != "nccl":
        msg = (
            f"the megatron back-end needs a GPU per rank (NCCL), but these {dist.get_world_size()} ranks run on gloo: "
            f"{torch.cuda.device_count()} GPUs for {os.environ.get('LOCAL_WORLD_SIZE', '?')} local ranks; set "
            f"policy.nproc_per_node to the GPUs per node"
        )
        raise RuntimeError(msg)
    sizes = (mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        held = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if held != sizes:
            msg = (
                f"this process already split its ranks as tensor x pipeline x context parallel = {held}; the config "
                f"asks for {sizes}"
            )
            raise ValueError(msg)
        return
    world = dist.get_world_size()
    if world % (sizes[0] * sizes[1] * sizes[2]):
        msg = (
            f"config policy.megatron_cfg: tensor x pipeline x context parallel sizes {sizes} need a multiple of "
            f"{sizes[0] * sizes[1] * sizes[2]} ranks, but the task has {world}; set policy.nproc_per_node (and nnodes) "
            f"to match"
        )
        raise ValueError(msg)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes[0], pipeline_model_parallel_size=sizes[1], context_parallel_size=sizes[2]
    )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """``GPTModel``'s rotary arguments from the HF config: ``rotary_base`` and Llama 3's frequency scaling.

    Raises:
        ValueError: a RoPE type other than the plain one or Llama 3's (with its default low/high frequency factors
            1 and 4 and original context 8192, which megatron-core hard-codes).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": base, "rope_scaling": False}
    if kind == "llama3" and (
        params.get("low_freq_factor", 1.0),
        params.get("high_freq_factor", 4.0),
        params.get("original_max_position_embeddings", 8192),
    ) == (1.0, 4.0, 8192):
        return {"rotary_base": base, "rope_scaling": True, "rope_scaling_factor": params.get("factor", 8.0)}
    msg = (
        f"model: RoPE {params} is not supported by the megatron back-end (plain RoPE and Llama 3's default scaling "
        f"are); use policy.backend 'transformers'"
    )
    raise ValueError(msg)


def check_model(hf_config: Any, mcfg: MegatronConfig) -> LlamaLayout:
    """Everything about the model the megatron back-end can check before it starts (no megatron-core or GPU needed:
    ``start_run`` calls it): a supported architecture, activation and RoPE, and parallel sizes its shapes allow.

    Returns:
        the model's :class:`LlamaLayout`.

    Raises:
        ValueError: what is not supported, with the fix.
    """
    layout = LlamaLayout.from_hf_config(hf_config)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        msg = (
            f"model: hidden_act {act!r} is not supported by the megatron back-end (SwiGLU with silu is); use "
            f"policy.backend 'transformers'"
        )
        raise ValueError(msg)
    rope_settings(hf_config)
    check_parallel_layout(
        layout,
        tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
    )
    return layout


def transformer_config(
    layout: LlamaLayout,
    hf_config: Any,
    mcfg: MegatronConfig,
    *,
    compute_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = False,
) -> Any:
    """megatron-core's ``TransformerConfig`` of the HF model: RMSNorm, SwiGLU (``gated_linear_unit`` with SiLU), no
    linear biases (q/k/v biases for Qwen2), grouped-query attention, no dropout, float32 parameters (bf16 compute comes
    from ``torch.autocast``, as in the transformers back-end), and the parallel sizes of ``mcfg``.

    ``compute_dtype`` is what the pipeline stages send each other: under bf16 autocast megatron-core's layers cast the
    residual stream to their bf16 output (``_bias_dropout_add_func``), so stages exchange bf16 activations.

    Raises:
        ValueError: what :func:`check_model` raises.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_model(hf_config, mcfg)
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
        context_parallel_size=mcfg.context_parallel_size,
        sequence_parallel=mcfg.sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=compute_dtype,
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # the schedule leaves each micro-batch's loss as it is: ours is already globally normalized
        calculate_per_token_loss=True,
    )


def build_gpt_model(
    layout: LlamaLayout,
    hf_config: Any,
    mcfg: MegatronConfig,
    *,
    device: str | torch.device = "cuda",
    compute_dtype: torch.dtype = torch.float32,
) -> Any:
    """This rank's stage of megatron-core's ``GPTModel`` (its tensor-parallel shard of its pipeline stage), with
    freshly initialised weights, in eval mode; load real ones with :func:`load_hf_state_dict`. Its LM head runs in
    ``compute_dtype`` on the positions a caller names, float32 on every position otherwise
    (:func:`selective_lm_head`).

    The layers are Transformer Engine's when it is installed, megatron-core's local ones otherwise (those have neither
    context nor sequence parallelism), with torch's ``scaled_dot_product_attention`` as their core attention
    (:func:`sdpa_attention_class`: flash attention on CUDA instead of the local spec's unfused softmax over
    [b, h, s, s]). Needs :func:`init_model_parallel` first.

    Raises:
        ValueError: ``context_parallel_size`` > 1 or ``sequence_parallel`` without Transformer Engine; what
            :func:`transformer_config` raises.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    te = has_transformer_engine()
    if mcfg.context_parallel_size > 1 and not te:
        msg = (
            "config policy.megatron_cfg.context_parallel_size > 1 needs Transformer Engine's attention (pip install "
            "transformer-engine[pytorch]); use 1 without it"
        )
        raise ValueError(msg)
    if mcfg.sequence_parallel and not te:
        msg = (
            "config policy.megatron_cfg.sequence_parallel needs Transformer Engine's layernorm (pip install "
            "transformer-engine[pytorch]); set it to false without it"
        )
        raise ValueError(msg)
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()  # torch's fused attention
    config = transformer_config(
        layout, hf_config, mcfg, compute_dtype=compute_dtype, use_cpu_initialization=torch.device(device).type == "cpu"
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size(mcfg.make_vocab_size_divisible_by, mcfg.tensor_model_parallel_size),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tie_word_embeddings,
        position_embedding_type="rope",
        parallel_output=True,
        **rope_settings(hf_config),
    )
    if model.post_process:
        selective_lm_head(model.output_layer, compute_dtype, sequence_parallel=mcfg.sequence_parallel)
    model.to(device)
    model.eval()
    return model


@functools.cache
def sdpa_attention_class() -> type:
    """megatron-core's local ``DotProductAttention`` whose forward is torch's ``scaled_dot_product_attention`` (flash or
    memory-efficient kernels; grouped-query attention without repeating the key-value heads) where it applies: causal
    self-attention without an explicit mask, dropout, window or query-key layer scaling. Anything else runs the
    parent's unfused forward. Same maths: softmax(q k^T * scale + causal mask) v (Vaswani et al. 2017; megatron-core's
    ``DotProductAttention``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):  # noqa: ANN001, ANN202
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            plain = (
                attention_mask is None
                and attention_bias is None
                and packed_seq_params is None
                and mask_type == AttnMaskType.causal
                and not (self.training and self.attention_dropout.p > 0)
                and not self.config.apply_query_key_layer_scaling
                and getattr(self.config, "window_size", None) is None
            )
            if not plain:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            sq, b = query.shape[0], query.shape[1]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, head_dim]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
            )  # [b, np, sq, hn]
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # [sq, b, np * hn]

    return SDPAttention


def selective_lm_head(layer: torch.nn.Module, compute_dtype: torch.dtype, *, sequence_parallel: bool = False) -> None:
    """Run ``layer`` (the LM head, a vocab-parallel ``ColumnParallelLinear``) only where it is asked to, from here on.

    With ``layer.wanted = (s_idx, b_idx)`` ([T] int64 each, on the device: the positions of the [s, b, H] hidden
    states that predict a wanted token) the head multiplies those T rows alone, in ``compute_dtype`` with float32
    logits out (:func:`head_matmul`), and returns [T, 1, V/t] (megatron's GPTModel hands it on as [1, T, V/t]); the
    transformers back-end does the same (`rl.backends.hf.lm_head`). With ``layer.wanted = None`` (top-k logits of
    every position) it runs on every position in float32, outside autocast: bf16 *output* would round a logit near
    20 to a multiple of 0.125. Under sequence parallelism each rank holds part of the positions: the head then
    always runs on every position (float32)."""
    forward = layer.forward
    layer.wanted = None

    def head(input_: torch.Tensor, weight: torch.Tensor | None = None, **kwargs: Any) -> Any:
        wanted = None if sequence_parallel else layer.wanted
        if wanted is None:
            with torch.autocast(
                device_type=input_.device.type, dtype=torch.bfloat16, enabled=False
            ):  # dtype given: never read from thread state
                return forward(input_.float(), weight=weight, **kwargs)
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        s_idx, b_idx = wanted
        x = copy_to_tensor_model_parallel_region(input_[s_idx, b_idx])  # [T, H]; backward: all-reduce over TP
        w = weight if weight is not None else layer.weight  # [V/t, H]
        return head_matmul(x, w, compute_dtype)[:, None, :], None  # [T, 1, V/t]

    layer.forward = head  # type: ignore[method-assign]


def head_matmul(x: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """[T, V] float32 logits ``x @ weight.T`` (``x`` [T, H], ``weight`` [V, H]) with both operands in ``compute_dtype``:
    bf16 inputs with float32 output where torch's ``mm(..., out_dtype=float32)`` exists for the device (CUDA), else
    the bf16 product widened; the backward's two matmuls in ``compute_dtype`` too (as autocast runs a linear layer)."""
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=False):
        return _HeadMatmul.apply(x, weight, compute_dtype)


@functools.cache
def _mm_out_dtype(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` takes bf16 operands on this device type."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class _HeadMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, compute_dtype):
        xl, wl = x.to(compute_dtype), weight.to(compute_dtype)
        ctx.save_for_backward(xl, wl)
        ctx.dtypes = x.dtype, weight.dtype
        if compute_dtype == torch.float32:
            return xl @ wl.T
        if _mm_out_dtype(x.device.type):
            return torch.mm(xl, wl.T, out_dtype=torch.float32)
        return (xl @ wl.T).float()

    @staticmethod
    def backward(ctx, grad):
        xl, wl = ctx.saved_tensors
        low = grad.to(xl.dtype)  # [T, V]
        grad_x = (low @ wl).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_w = (low.T @ xl).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def uses_te_layernorm(model: torch.nn.Module) -> bool:
    """Whether the model's layernorms are fused into its linear layers (Transformer Engine's layer spec)."""
    return any(k.endswith("linear_qkv.layer_norm_weight") for k in model.state_dict())


def load_hf_state_dict(
    model: torch.nn.Module, hf: Mapping[str, torch.Tensor], layout: LlamaLayout, mcfg: MegatronConfig
) -> None:
    """Copy the whole model's HF weights into this rank's shard of ``model`` (converted, split by tensor-parallel rank
    and pipeline stage).

    Raises:
        ValueError: the converted shard and the module disagree on names or shapes (named).
    """
    from megatron.core import parallel_state

    mc = hf_to_megatron(
        hf,
        layout,
        padded_vocab_size=layout.padded_vocab_size(mcfg.make_vocab_size_divisible_by, mcfg.tensor_model_parallel_size),
        te_layernorm=uses_te_layernorm(model),
    )
    mc = shard_tensor_parallel(
        mc, layout, rank=parallel_state.get_tensor_model_parallel_rank(), size=mcfg.tensor_model_parallel_size
    )
    mc = split_pipeline_stage(
        mc, layout, rank=parallel_state.get_pipeline_model_parallel_rank(), size=mcfg.pipeline_model_parallel_size
    )
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if set(own) != set(mc):
        msg = (
            f"megatron weights do not fit the model: missing {sorted(set(own) - set(mc))}, unexpected "
            f"{sorted(set(mc) - set(own))}"
        )
        raise ValueError(msg)
    wrong = [f"{k}: {tuple(mc[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if mc[k].shape != v.shape]
    if wrong:
        msg = f"megatron weights do not fit the model's shapes: {wrong}"
        raise ValueError(msg)
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(mc[k])


def local_shard(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's weights on the CPU, without megatron's ``_extra_state`` entries."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


_REPLICA_GROUP: dict[int, Any] = {}
"""The gloo group of the model-parallel ranks of replica 0, per world size (created once: ``new_group`` is
collective)."""


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Collective: ``obj`` of every model-parallel rank (tensor x pipeline) of data-parallel replica 0, context-parallel
    rank 0, on global rank 0 in group order; None on every other rank.

    The objects travel over a gloo group of just those ranks, so they are pickled in host memory (``gather_object``
    over NCCL would stage ranks x the largest object on rank 0's GPU), and the other replicas, which hold copies, send
    nothing.
    Without model parallelism rank 0 holds everything: ``[obj]`` there, no communication.
    """
    from megatron.core import parallel_state

    rank = dist.get_rank()
    if parallel_state.get_model_parallel_group().size() == 1:
        return [obj] if rank == 0 else None
    world = dist.get_world_size()
    if world not in _REPLICA_GROUP:
        mine = (rank, parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        _REPLICA_GROUP[world] = (
            dist.new_group([r for r, member in every if member], backend="gloo"),
            {r for r, member in every if member},
        )
    group, members = _REPLICA_GROUP[world]
    if rank not in members:
        return None
    parts: list[Any] | None = [None] * len(members) if rank == 0 else None
    dist.gather_object(obj, parts, dst=0, group=group)
    return parts


def gather_hf_state_dict(
    model: torch.nn.Module, layout: LlamaLayout, mcfg: MegatronConfig
) -> dict[str, torch.Tensor] | None:
    """Collective: the whole model's weights under HF names, float32 on the CPU, on global rank 0 (None elsewhere).

    Each (tensor-parallel rank, pipeline stage) of replica 0 sends its shard to rank 0 (:func:`gather_to_rank0`), which
    merges the tensor-parallel shards of each stage, then the stages, and maps the names back
    (`rl.backends.megatron.convert`).
    """
    from megatron.core import parallel_state

    mine = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        local_shard(model),
    )
    parts = gather_to_rank0(mine)
    if parts is None:
        return None
    by_stage: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for stage, tp_rank, shard in parts:
        by_stage.setdefault(stage, {})[tp_rank] = shard
    stages = [merge_tensor_parallel([by_stage[p][t] for t in sorted(by_stage[p])], layout) for p in sorted(by_stage)]
    return megatron_to_hf(merge_pipeline_stages(stages, layout), layout, te_layernorm=uses_te_layernorm(model))


class HFFolder:
    """A whole model's HF state dict and config with ``save_pretrained(folder)``, what ``rl.checkpoint.save`` writes:
    the transformers model class is built on the meta device and handed the tensors, so the folder is exactly what
    ``AutoModelForCausalLM.from_pretrained`` reads (tied weights, sharding of large models)."""

    def __init__(self, hf_config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.config = hf_config
        self.state_dict = dict(state_dict)

    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        tensors = dict(self.state_dict)
        if getattr(self.config, "tie_word_embeddings", False):
            tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
        model.load_state_dict(tensors, strict=True, assign=True)
        model.tie_weights()
        model.save_pretrained(folder)
