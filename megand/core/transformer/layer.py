"""A transformer layer: its norms placed before each branch (pre-norm), on each branch's output (post:
OLMo 2/3) or both (sandwich: Gemma 2/3), as ``model.norm_placement`` says."""

from dataclasses import replace

import torch
import torch.nn.functional as F

from megand.core.sharding import split_by_tokens
from megand.core.tensor_parallel import checkpoint
from megand.core.transformer.attention import Attention
from megand.core.transformer.gated_deltanet import GatedDeltaNet
from megand.core.transformer.mla import LatentAttention
from megand.core.transformer.mlp import MLP
from megand.core.transformer.moe import MoE
from megand.core.transformer.norms import Norm
from megand.core.transformer.per_layer_input import PerLayerInput


class TransformerLayer(torch.nn.Module):
    def __init__(self, cfg, topo, rng, device=None, layer_id=0):
        """``device``: where the parameters are created (default ``topo.device``; ``meta``: shapes only);
        ``layer_id``: the layer's global index (MoE layers are every ``moe_layer_freq``-th)."""
        device = topo.device if device is None else device
        super().__init__()
        self.cfg, self.rng = cfg, rng
        norm = dict(eps=cfg.norm_eps, input_split=split_by_tokens(cfg.sequence_parallel), tp_rank=topo.tp_rank,
                    tp_size=topo.tp_size, dtype=cfg.params_dtype, device=device, unit_offset=cfg.norm_unit_offset)
        pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
        self.input_norm = Norm(cfg.norm, cfg.hidden_size, **norm) if pre else None
        # the token mixer: Gated DeltaNet where model.layer_types says so, else (latent) attention
        attention = (GatedDeltaNet if cfg.is_linear_attention(layer_id) else
                     LatentAttention if cfg.multi_latent else Attention)
        self.attention = attention(cfg, topo, rng, device, layer_id)
        # the norms on the branch outputs (before the residual add)
        self.attention_output_norm = Norm(cfg.norm, cfg.hidden_size, **norm) if post else None
        self.post_attention_norm = Norm(cfg.norm, cfg.hidden_size, **norm) if pre else None  # the MLP's input norm
        moe = cfg.is_moe_layer(layer_id)
        width = cfg.ffn_width(layer_id)  # the key/value-sharing layers' double-wide MLP (model.double_wide_mlp)
        self.mlp = MoE(cfg, topo, device) if moe and not cfg.moe_beside_mlp else MLP(
            cfg if width == cfg.ffn_hidden_size else replace(cfg, ffn_hidden_size=width), topo, device)
        self.mlp_output_norm = Norm(cfg.norm, cfg.hidden_size, **norm) if post else None
        # Gemma 4's MoE block (model.moe_beside_mlp): the routed experts beside the dense MLP, on the residual with
        # an input norm of their own; each branch's output normalised before the two are added
        self.moe = self.moe_input_norm = self.mlp_branch_norm = self.moe_output_norm = None
        if moe and cfg.moe_beside_mlp:
            self.moe = MoE(cfg, topo, device)
            self.moe_input_norm, self.mlp_branch_norm, self.moe_output_norm = (
                Norm(cfg.norm, cfg.hidden_size, **norm) for _ in range(3))
        # per-layer input embeddings (model.per_layer_input_size): a gated branch after the MLP's residual add
        self.per_layer_input = PerLayerInput(cfg, topo, device) if cfg.per_layer_input_size else None
        self.rope_kind = cfg.layer_rope(layer_id)  # which of the model's RoPE tables this layer reads (None: NoPE)
        self.compiled = None  # the compiled body (compile_body), else the body runs eagerly

    def compile_body(self, compiler, eager) -> None:
        """Run this layer's body (under full recomputation: the body its checkpoint recomputes) as
        ``compiler(body)`` (``torch.compile``), and what the compiler cannot trace through ``eager``
        (``torch.compiler.disable``). What runs around the body (the module hooks, the checkpoint of full
        recomputation) stays eager."""
        for block in (self.attention, self.mlp, self.moe):
            if hasattr(block, "keep_eager"):
                block.keep_eager(eager)
        self.compiled = compiler(self._forward)

    def dropout(self, x):
        if not self.training or self.cfg.hidden_dropout == 0.0:
            return x
        if self.cfg.sequence_parallel:  # each tp rank holds other tokens: draw other masks
            with self.rng.fork():
                return F.dropout(x, self.cfg.hidden_dropout)
        return F.dropout(x, self.cfg.hidden_dropout)

    @staticmethod
    def _norm(norm, x):
        return x if norm is None else norm(x)

    def _forward(self, x, rope, cache=None, documents=None, shared=None, ids=None, projected=None):
        h = self.attention(self._norm(self.input_norm, x), rope, cache, documents, **self._shared(shared))
        x = x + self.dropout(self._norm(self.attention_output_norm, h))
        h = self.mlp(self._norm(self.post_attention_norm, x))
        if self.moe is not None:  # the router reads the residual itself, the experts their own norm of it
            h = self.mlp_branch_norm(h) + self.moe_output_norm(self.moe(self.moe_input_norm(x), route_from=x))
        x = x + self.dropout(self._norm(self.mlp_output_norm, h))
        if self.per_layer_input is not None:
            x = self.per_layer_input(x, ids, projected)
        return x

    def _shared(self, shared) -> dict:
        """The keys and values shared across layers (model.num_kv_shared_layers), for attention that reads them."""
        return {} if shared is None else {"shared": shared}

    def forward(self, x, rope=None, cache=None, documents=None, shared=None, per_layer=None):
        """``cache``: this layer's :class:`~megand.core.transformer.kv_cache.LayerKVCache` (generation);
        ``documents``: a :class:`~megand.core.transformer.documents.DocumentMask` (attention within documents);
        ``rope``: the model's RoPE tables by kind (``{"global": (cos, sin), "local": ...}``), of which the layer
        reads its own; ``shared``: the forward's keys and values by layer id (model.num_kv_shared_layers);
        ``per_layer``: with per-layer input embeddings, ``(token ids [b, s], this layer's columns of the projected
        word embedding [s, b, p])``."""
        rope = None if rope is None or self.rope_kind is None else rope[self.rope_kind]
        ids, projected = (None, None) if per_layer is None else per_layer
        if cache is not None:
            return self._forward(x, rope, cache, None, shared, ids, projected)
        body = self._forward if self.compiled is None else self.compiled
        if self.cfg.recompute == "full":  # what this layer leaves in ``shared`` is recomputed in backward too
            return checkpoint(body, x, rope, None, documents, shared, ids, projected, rng=self.rng)
        return body(x, rope, None, documents, shared, ids, projected)
