"""The exact weight mapping between a Hugging Face Llama-family causal LM (Llama, SmolLM2, Mistral, Qwen2) and
megatron-core's ``GPTModel``, and its tensor-parallel shards and pipeline stages. Pure tensor maths: every value is
copied, never computed, so every round trip is bit-identical.

Layouts (megatron-core 0.16; Megatron-Bridge's Llama ``QKVMapping`` and ``GatedMLPMapping`` are the reference):

- ``self_attention.linear_qkv`` (``ColumnParallelLinear``) holds q, k and v interleaved by query group: for each of the
  ``nkv`` groups, its ``nq / nkv`` query heads, then its key head, then its value head (``d`` rows each).
  ``SelfAttention`` views the output as ``[..., ng, (nq / ng + 2) * d]`` and splits the last dimension, so a
  tensor-parallel rank holding ``nkv / t`` consecutive groups holds a contiguous block of rows.
- ``mlp.linear_fc1`` (``ColumnParallelLinear``, ``gated_linear_unit``) is ``cat(gate, up)``; megatron's SwiGLU chunks
  each rank's output in two, so a rank holds ``cat(gate_r, up_r)``, not a contiguous block of the full matrix.
- ``linear_proj`` and ``linear_fc2`` (``RowParallelLinear``) are split along their input (column) dimension; the word
  embeddings (``VocabParallelEmbedding``) and ``output_layer`` along the vocabulary, padded to
  :meth:`LlamaLayout.padded_vocab_size` with zero rows that :func:`megatron_to_hf` drops.
- Layernorm weights are replicated on every tensor-parallel rank. Under the Transformer-Engine layer spec they are fused
  into the next linear layer (``te_layernorm``): ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``.

Names are those of ``GPTModel.state_dict()`` (megatron's ``_extra_state`` entries are ignored). Returned tensors never
alias the input ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""HF ``model_type`` values whose weights this module maps (same decoder layer; Qwen2 adds q/k/v biases)."""

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_LAYERNORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"

_REPLICATED, _ROWS, _COLUMNS, _GATED = "replicated", "rows", "columns", "gated"
"""How a weight is split over tensor-parallel ranks: copied whole, along dim 0, along dim 1, or gate and up halves of
dim 0 each split along dim 0."""

_TOP_LEVEL_SPLIT = {EMBEDDING: _ROWS, FINAL_LAYERNORM: _REPLICATED, OUTPUT_LAYER: _ROWS}
_LAYER_SPLIT = {
    "input_layernorm.weight": _REPLICATED,
    # Transformer Engine: input_layernorm fused into linear_qkv
    "self_attention.linear_qkv.layer_norm_weight": _REPLICATED,
    "self_attention.linear_qkv.weight": _ROWS,
    "self_attention.linear_qkv.bias": _ROWS,
    "self_attention.linear_proj.weight": _COLUMNS,
    "pre_mlp_layernorm.weight": _REPLICATED,
    "mlp.linear_fc1.layer_norm_weight": _REPLICATED,  # Transformer Engine: pre_mlp_layernorm fused into linear_fc1
    "mlp.linear_fc1.weight": _GATED,
    "mlp.linear_fc2.weight": _COLUMNS,
}
"""Tensor-parallel split of every weight of a decoder layer, by its name inside ``decoder.layers.{i}``."""
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class LlamaLayout:
    """The shapes that fix the weight mapping of a Llama-family decoder."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key-value heads (grouped-query attention); equal to ``num_attention_heads`` for multi-head attention."""
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """The HF vocabulary (rows of ``model.embed_tokens.weight``), before megatron's padding."""
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """q, k and v projections have biases (Qwen2); the output projection and the MLP never do."""

    def __post_init__(self) -> None:
        sizes = (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        )
        for name in sizes:
            if getattr(self, name) < 1:
                msg = f"LlamaLayout.{name} is {getattr(self, name)}; use 1 or more"
                raise ValueError(msg)
        if self.num_attention_heads % self.num_query_groups:
            msg = (
                f"LlamaLayout: {self.num_query_groups} key-value heads do not divide {self.num_attention_heads} "
                f"attention heads"
            )
            raise ValueError(msg)

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaLayout:
        """The layout of a transformers ``LlamaConfig``, ``MistralConfig`` or ``Qwen2Config``.

        Raises:
            ValueError: another ``model_type``; ``attention_bias`` (Llama's flag also puts a bias on ``o_proj``, which
                megatron's ``linear_proj`` does not get here) or ``mlp_bias``.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            msg = (
                f"model: model_type {model_type!r} is not supported by the megatron back-end (only "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} are); use policy.backend 'transformers'"
            )
            raise ValueError(msg)
        for flag, what in (
            ("attention_bias", "biases on q_proj, k_proj, v_proj and o_proj"),
            ("mlp_bias", "biases on the MLP projections"),
        ):
            if getattr(config, flag, False):
                msg = (
                    f"model: {flag}=True ({what}) is not supported by the megatron back-end (q/k/v biases alone are, "
                    f"as in Qwen2); use policy.backend 'transformers'"
                )
                raise ValueError(msg)
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=model_type == "qwen2",
        )

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key-value head."""
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
        """Megatron-LM's padded vocabulary: ``vocab_size`` rounded up to a multiple of
        ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (every rank gets an equal, aligned share)."""
        if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
            msg = (
                f"padded_vocab_size needs sizes of 1 or more, not {make_vocab_size_divisible_by} and "
                f"{tensor_model_parallel_size}"
            )
            raise ValueError(msg)
        multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple


def check_parallel_layout(
    layout: LlamaLayout, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int
) -> None:
    """Check that the model's shapes split evenly: tensor parallelism over attention heads, key-value heads and the MLP
    width, pipeline parallelism over the layers (equal stages).

    Raises:
        ValueError: ``"config policy.megatron_cfg.<size>: ...; use one of ..."``, naming the sizes that would work.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if size < 1:
            msg = f"config policy.megatron_cfg.{key}: is {size}; use 1 or more"
            raise ValueError(msg)
    splits = (
        (layout.num_attention_heads, "attention heads"),
        (layout.num_query_groups, "key-value heads"),
        (layout.ffn_hidden_size, "MLP channels"),
    )
    for count, what in splits:
        if count % tp:
            ok = [t for t in _divisors(layout.num_query_groups) if all(n % t == 0 for n, _ in splits)]
            (heads, _), (groups, _), (ffn, _) = splits
            every = f"{heads} attention heads, {groups} key-value heads and {ffn} MLP channels"
            msg = (
                f"config policy.megatron_cfg.tensor_model_parallel_size: {tp} does not divide the model's {count} "
                f"{what}; use one of {_listed(ok)} (they divide its {every})"
            )
            raise ValueError(msg)
    _check_pipeline_size(layout.num_layers, pp)


def pipeline_stage_layers(num_layers: int, *, rank: int, size: int) -> range:
    """Global indices of the layers on pipeline stage ``rank`` of ``size`` (equal, consecutive stages).

    Raises:
        ValueError: ``size`` does not divide ``num_layers``; ``rank`` is not in ``[0, size)``.
    """
    _check_pipeline_size(num_layers, size)
    if not 0 <= rank < size:
        msg = f"pipeline stage {rank} does not exist: there are {size} stages"
        raise ValueError(msg)
    per_stage = num_layers // size
    return range(rank * per_stage, (rank + 1) * per_stage)


def hf_to_megatron(
    hf: Mapping[str, Tensor], layout: LlamaLayout, *, padded_vocab_size: int | None = None, te_layernorm: bool = False
) -> dict[str, Tensor]:
    """The whole (unsharded) megatron state dict of an HF state dict, global layer numbering.

    ``padded_vocab_size`` (default ``layout.vocab_size``) rows of word embeddings and output layer, the rows past the
    vocabulary zero. A tied model's ``lm_head.weight`` (``model.state_dict()`` lists it, ``save_pretrained`` does not)
    may be there if it equals ``model.embed_tokens.weight``; megatron's GPTModel then has no ``output_layer.weight``.
    ``te_layernorm`` names the layernorms as the Transformer-Engine spec does. ``rotary_emb.inv_freq`` buffers are
    ignored.

    Raises:
        ValueError: missing or unknown keys, or wrong shapes (named); ``padded_vocab_size < vocab_size``; a tied
            ``lm_head.weight`` that differs from the embeddings.
    """
    rows = layout.vocab_size if padded_vocab_size is None else padded_vocab_size
    if rows < layout.vocab_size:
        msg = f"padded_vocab_size {rows} is smaller than the vocabulary ({layout.vocab_size})"
        raise ValueError(msg)
    tied_head = layout.tie_word_embeddings and "lm_head.weight" in hf
    expected = _hf_shapes(layout) | ({"lm_head.weight": (layout.vocab_size, layout.hidden_size)} if tied_head else {})
    hf = _checked(hf, expected, "Hugging Face", ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    if tied_head and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
        msg = "tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight"
        raise ValueError(msg)
    mc = {EMBEDDING: _pad_rows(hf["model.embed_tokens.weight"], rows)}  # [V_pad, H]
    for i in range(layout.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mc_name in _copied_layer_weights(te_layernorm).items():
            mc[dst + mc_name] = hf[src + hf_name].clone()
        for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
            q, k, v = (hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            mc[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                q, k, v, layout
            )  # [(nq + 2 nkv) d, H] or [(nq + 2 nkv) d]
        mc[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )  # [2F, H]
    mc[FINAL_LAYERNORM] = hf["model.norm.weight"].clone()
    if not layout.tie_word_embeddings:
        mc[OUTPUT_LAYER] = _pad_rows(hf["lm_head.weight"], rows)  # [V_pad, H]
    return mc


def megatron_to_hf(mc: Mapping[str, Tensor], layout: LlamaLayout, *, te_layernorm: bool = False) -> dict[str, Tensor]:
    """The HF state dict of a whole (merged) megatron state dict: exactly the keys ``save_pretrained`` writes, so no
    ``lm_head.weight`` for a tied model. The padded vocabulary rows are dropped (whatever training left in them).

    Raises:
        ValueError: missing or unknown keys (``_extra_state`` entries aside) or wrong shapes, named.
    """
    rows = (
        max(mc[EMBEDDING].shape[0], layout.vocab_size) if EMBEDDING in mc else layout.vocab_size
    )  # V_pad (fewer rows: a shape error)
    mc = _checked(mc, _megatron_shapes(layout, rows, te_layernorm), "megatron", ignore=_is_extra_state)
    hf = {"model.embed_tokens.weight": mc[EMBEDDING][: layout.vocab_size].clone()}  # [V, H]
    copied = _copied_layer_weights(te_layernorm)
    for i in range(layout.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
            q, k, v = _split_qkv(mc[f"{src}self_attention.linear_qkv.{kind}"], layout)
            hf |= {
                f"{dst}self_attn.q_proj.{kind}": q,
                f"{dst}self_attn.k_proj.{kind}": k,
                f"{dst}self_attn.v_proj.{kind}": v,
            }
        gate, up = mc[src + "mlp.linear_fc1.weight"].chunk(2)  # [F, H] each
        hf |= {dst + "mlp.gate_proj.weight": gate.clone(), dst + "mlp.up_proj.weight": up.clone()}
        hf |= {dst + hf_name: mc[src + mc_name].clone() for hf_name, mc_name in copied.items()}
    hf["model.norm.weight"] = mc[FINAL_LAYERNORM].clone()
    if not layout.tie_word_embeddings:
        hf["lm_head.weight"] = mc[OUTPUT_LAYER][: layout.vocab_size].clone()
    return hf


def shard_tensor_parallel(mc: Mapping[str, Tensor], layout: LlamaLayout, *, rank: int, size: int) -> dict[str, Tensor]:
    """Tensor-parallel rank ``rank``'s share of a megatron state dict (whole, or one pipeline stage of it), named as in
    the rank's ``GPTModel``: the shapes ``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding``
    allocate (see the module docstring). ``_extra_state`` entries are dropped.

    Raises:
        ValueError: shapes the size does not split (:func:`check_parallel_layout`, or a vocabulary not padded to a
            multiple of ``size``); an unknown key; ``rank`` not in ``[0, size)``.
    """
    check_parallel_layout(layout, tensor_model_parallel_size=size, pipeline_model_parallel_size=1)
    if not 0 <= rank < size:
        msg = f"tensor-parallel rank {rank} does not exist: there are {size} ranks"
        raise ValueError(msg)
    shard = {}
    for key, tensor in _weights(mc).items():
        how = _tensor_parallel_split(key)
        if how == _REPLICATED:
            shard[key] = tensor.clone()
            continue
        dim = 1 if how == _COLUMNS else 0
        _check_even_split(key, tensor, 2 * size if how == _GATED else size, dim)
        if how == _GATED:  # [2F, H] -> cat(gate_r, up_r): [2F / t, H]
            gate, up = tensor.chunk(2)
            shard[key] = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
        else:  # [V_pad / t, H], [(nq + 2 nkv) d / t, H], [(nq + 2 nkv) d / t], [H, nq d / t] or [H, F / t]
            shard[key] = tensor.chunk(size, dim)[rank].clone()
    return shard


def merge_tensor_parallel(shards: Sequence[Mapping[str, Tensor]], layout: LlamaLayout) -> dict[str, Tensor]:
    """The state dict the tensor-parallel ``shards`` (rank order) were cut from: the inverse of
    :func:`shard_tensor_parallel`. ``_extra_state`` entries are dropped.

    Raises:
        ValueError: no shards; shards with different keys; a replicated (layernorm) weight that differs between ranks;
            an unknown key.
    """
    if not shards:
        msg = "merge_tensor_parallel needs at least one shard"
        raise ValueError(msg)
    check_parallel_layout(layout, tensor_model_parallel_size=len(shards), pipeline_model_parallel_size=1)
    parts = [_weights(shard) for shard in shards]
    for rank, part in enumerate(parts[1:], start=1):
        if part.keys() != parts[0].keys():
            msg = (
                f"tensor-parallel rank {rank} has other weights than rank 0: "
                f"{_listed(sorted(part.keys() ^ parts[0].keys()))}"
            )
            raise ValueError(msg)
    merged = {}
    for key in parts[0]:
        pieces = [part[key] for part in parts]
        how = _tensor_parallel_split(key)
        if how == _REPLICATED:
            differ = [rank for rank, piece in enumerate(pieces) if not torch.equal(piece, pieces[0])]
            if differ:
                msg = f"{key} is replicated over the tensor-parallel ranks but ranks {differ} differ from rank 0"
                raise ValueError(msg)
            merged[key] = pieces[0].clone()
        elif how == _GATED:  # t x [2F / t, H] -> cat(gate_0 .. gate_t-1, up_0 .. up_t-1): [2F, H]
            halves = [piece.chunk(2) for piece in pieces]
            merged[key] = torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
        else:
            merged[key] = torch.cat(pieces, 0 if how == _ROWS else 1)
    return merged


def split_pipeline_stage(mc: Mapping[str, Tensor], layout: LlamaLayout, *, rank: int, size: int) -> dict[str, Tensor]:
    """Pipeline stage ``rank``'s part of a megatron state dict (whole, or one tensor-parallel shard of it), named as in
    that stage's ``GPTModel``: its layers (:func:`pipeline_stage_layers`) renumbered from 0, the word embeddings on the
    first stage, the final layernorm and output layer on the last. With tied embeddings and ``size > 1`` the last stage
    also holds ``output_layer.weight``, a copy of the word embeddings (megatron's shared embedding). ``_extra_state``
    entries are dropped.

    Raises:
        ValueError: what :func:`pipeline_stage_layers` raises; an unknown key or a layer past ``layout.num_layers``; a
            tied model with an ``output_layer.weight``, or one without word embeddings.
    """
    layers = pipeline_stage_layers(layout.num_layers, rank=rank, size=size)
    first, last = rank == 0, rank == size - 1
    stage = {}
    for key, tensor in _weights(mc).items():
        layer, name = _parse_key(key)
        if layer is not None and layer >= layout.num_layers:
            msg = f"{key}: the model has {layout.num_layers} layers"
            raise ValueError(msg)
        if layout.tie_word_embeddings and key == OUTPUT_LAYER:
            msg = f"{OUTPUT_LAYER} in a model with tied word embeddings: megatron shares {EMBEDDING} instead"
            raise ValueError(msg)
        if layer is not None:
            if layer in layers:
                stage[f"decoder.layers.{layer - layers.start}.{name}"] = tensor.clone()
        elif (key == EMBEDDING and first) or (key in (FINAL_LAYERNORM, OUTPUT_LAYER) and last):
            stage[key] = tensor.clone()
    if layout.tie_word_embeddings and last and size > 1:
        if EMBEDDING not in mc:
            msg = f"{EMBEDDING} is missing: the last pipeline stage holds a copy of it as {OUTPUT_LAYER}"
            raise ValueError(msg)
        stage[OUTPUT_LAYER] = mc[EMBEDDING].clone()
    return stage


def merge_pipeline_stages(stages: Sequence[Mapping[str, Tensor]], layout: LlamaLayout) -> dict[str, Tensor]:
    """The state dict the pipeline ``stages`` (stage order) were cut from, global layer numbering: the inverse of
    :func:`split_pipeline_stage`. A tied model's copy of the word embeddings on the last stage is checked and dropped.
    ``_extra_state`` entries are dropped.

    Raises:
        ValueError: what :func:`pipeline_stage_layers` raises; a stage with more layers than its share, with word
            embeddings (not first) or a final layernorm or output layer (not last); a tied model's last-stage copy of
            the embeddings that differs from the first stage's; an unknown key.
    """
    if not stages:
        msg = "merge_pipeline_stages needs at least one stage"
        raise ValueError(msg)
    merged = {}
    for rank, stage in enumerate(stages):
        layers = pipeline_stage_layers(layout.num_layers, rank=rank, size=len(stages))
        first, last = rank == 0, rank == len(stages) - 1
        for key, tensor in _weights(stage).items():
            layer, name = _parse_key(key)
            if layer is not None:
                if layer >= len(layers):
                    msg = f"pipeline stage {rank} has {key}, but holds only {len(layers)} layers"
                    raise ValueError(msg)
                merged[f"decoder.layers.{layers.start + layer}.{name}"] = tensor.clone()
            elif (key == EMBEDDING and not first) or (key != EMBEDDING and not last):
                msg = (
                    f"pipeline stage {rank} of {len(stages)} has {key}, which belongs to the "
                    f"{'first' if key == EMBEDDING else 'last'} stage"
                )
                raise ValueError(msg)
            elif key == OUTPUT_LAYER and layout.tie_word_embeddings:
                _check_tied_copy(tensor, stages[0])
            else:
                merged[key] = tensor.clone()
    return merged


def _check_tied_copy(copy: Tensor, first_stage: Mapping[str, Tensor]) -> None:
    """Check the last stage's copy of the tied word embeddings against the first stage's."""
    if EMBEDDING not in first_stage or not torch.equal(copy, first_stage[EMBEDDING]):
        msg = (
            f"the last pipeline stage's {OUTPUT_LAYER} (the tied copy of the word embeddings) differs from the first "
            f"stage's {EMBEDDING}"
        )
        raise ValueError(msg)


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, layout: LlamaLayout) -> Tensor:
    """``linear_qkv`` of HF's q [nq d, ...], k [nkv d, ...] and v [nkv d, ...]: per query group g its query heads, k_g,
    v_g, i.e. [(nq + 2 nkv) d, ...] (trailing dims: H for weights, none for biases)."""
    g, rest = layout.num_query_groups, q.shape[1:]
    grouped = [
        q.reshape(g, layout.heads_per_group * layout.head_dim, *rest),
        k.reshape(g, layout.head_dim, *rest),
        v.reshape(g, layout.head_dim, *rest),
    ]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)  # [g, (nq / g + 2) d, ...] -> [(nq + 2 nkv) d, ...]


def _split_qkv(qkv: Tensor, layout: LlamaLayout) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`_fuse_qkv`: HF's q [nq d, ...], k [nkv d, ...], v [nkv d, ...]."""
    g, d, rest = layout.num_query_groups, layout.head_dim, qkv.shape[1:]
    q, k, v = qkv.reshape(g, (layout.heads_per_group + 2) * d, *rest).split([layout.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()


def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    """``weight`` [V, H] with zero rows appended up to [rows, H]."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _copied_layer_weights(te_layernorm: bool) -> dict[str, str]:
    """HF name -> megatron name (inside a layer) of the weights copied unchanged."""
    return {
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"
        if te_layernorm
        else "input_layernorm.weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"
        if te_layernorm
        else "pre_mlp_layernorm.weight",
    }


def _hf_shapes(layout: LlamaLayout) -> dict[str, tuple[int, ...]]:
    """Every key of the HF state dict ``save_pretrained`` writes, with its shape."""
    h, f, d = layout.hidden_size, layout.ffn_hidden_size, layout.head_dim
    nq, nkv = layout.num_attention_heads * d, layout.num_query_groups * d  # rows of q_proj, of k_proj and v_proj
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (layout.vocab_size, h)}
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", nq), ("k", nkv), ("v", nkv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if layout.qkv_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes |= {
            p + "self_attn.o_proj.weight": (h, nq),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not layout.tie_word_embeddings:
        shapes["lm_head.weight"] = (layout.vocab_size, h)
    return shapes


def _megatron_shapes(layout: LlamaLayout, vocab_rows: int, te_layernorm: bool) -> dict[str, tuple[int, ...]]:
    """Every key of the whole megatron state dict (no ``_extra_state``), with its shape."""
    h, f, d = layout.hidden_size, layout.ffn_hidden_size, layout.head_dim
    qkv = (layout.num_attention_heads + 2 * layout.num_query_groups) * d
    copied = _copied_layer_weights(te_layernorm)
    layer = {
        copied["input_layernorm.weight"]: (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        **({"self_attention.linear_qkv.bias": (qkv,)} if layout.qkv_bias else {}),
        "self_attention.linear_proj.weight": (h, layout.num_attention_heads * d),
        copied["post_attention_layernorm.weight"]: (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
    }
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (vocab_rows, h)}
    shapes |= {f"decoder.layers.{i}.{name}": shape for i in range(layout.num_layers) for name, shape in layer.items()}
    shapes[FINAL_LAYERNORM] = (h,)
    if not layout.tie_word_embeddings:
        shapes[OUTPUT_LAYER] = (vocab_rows, h)
    return shapes


def _checked(
    sd: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]], what: str, *, ignore: Callable[[str], bool]
) -> dict[str, Tensor]:
    """``sd`` without its ignored keys, once its keys and shapes are exactly ``shapes``'s.

    Raises:
        ValueError: naming the missing, unknown or misshapen keys.
    """
    kept = {k: v for k, v in sd.items() if not ignore(k)}
    missing, unknown = [k for k in shapes if k not in kept], [k for k in kept if k not in shapes]
    if missing or unknown:
        msg = f"{what} state dict does not fit the model layout: missing {_listed(missing)}; unknown {_listed(unknown)}"
        raise ValueError(msg)
    wrong = [f"{k} {tuple(v.shape)} (expected {shapes[k]})" for k, v in kept.items() if tuple(v.shape) != shapes[k]]
    if wrong:
        msg = f"{what} state dict has wrong shapes: {_listed(wrong)}"
        raise ValueError(msg)
    return kept


def _parse_key(key: str) -> tuple[int | None, str]:
    """(layer index, name inside the layer) of a layer's weight, (None, key) of a top-level one.

    Raises:
        ValueError: not a weight of a Llama-family GPTModel.
    """
    match = _LAYER_KEY.fullmatch(key)
    if match and match[2] in _LAYER_SPLIT:
        return int(match[1]), match[2]
    if key in _TOP_LEVEL_SPLIT:
        return None, key
    msg = (
        f"{key!r} is not a weight of megatron-core's GPTModel for a Llama-family model (those are "
        f"{_listed(_TOP_LEVEL_SPLIT)} and decoder.layers.<i>.{{{_listed(_LAYER_SPLIT)}}})"
    )
    raise ValueError(msg)


def _tensor_parallel_split(key: str) -> str:
    """How ``key`` is split over tensor-parallel ranks (``_REPLICATED``, ``_ROWS``, ``_COLUMNS`` or ``_GATED``)."""
    layer, name = _parse_key(key)
    return _TOP_LEVEL_SPLIT[key] if layer is None else _LAYER_SPLIT[name]


def _check_even_split(key: str, tensor: Tensor, parts: int, dim: int) -> None:
    """Raise a ValueError unless dimension ``dim`` of ``tensor`` splits into ``parts`` equal chunks."""
    if tensor.shape[dim] % parts:
        fix = " (pad the vocabulary to LlamaLayout.padded_vocab_size)" if key in (EMBEDDING, OUTPUT_LAYER) else ""
        msg = f"{key}: dimension {dim} of shape {tuple(tensor.shape)} does not split into {parts} equal parts{fix}"
        raise ValueError(msg)


def _weights(sd: Mapping[str, Any]) -> dict[str, Tensor]:
    """``sd`` without megatron's ``_extra_state`` entries."""
    return {k: v for k, v in sd.items() if not _is_extra_state(k)}


def _is_extra_state(key: str) -> bool:
    return key.endswith("_extra_state")


def _check_pipeline_size(num_layers: int, size: int) -> None:
    if size < 1 or num_layers % size:
        msg = (
            f"config policy.megatron_cfg.pipeline_model_parallel_size: {size} does not divide the model's {num_layers} "
            f"layers; use one of {_listed(_divisors(num_layers))}"
        )
        raise ValueError(msg)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _listed(items: Iterable[Any], most: int = 8) -> str:
    """``a, b, c`` (at most ``most`` items, then how many more); ``none`` when empty."""
    items = list(items)
    shown = ", ".join(str(i) for i in items[:most])
    return (shown + (f" and {len(items) - most} more" if len(items) > most else "")) or "none"
