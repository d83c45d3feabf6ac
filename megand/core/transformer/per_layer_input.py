"""Per-layer input embeddings (Gemma 4's PLE, ``model.per_layer_input_size`` = p).

Beside the residual stream, layer ``l`` reads an input of its own per token,
``u_l = (norm_p(x W_l / sqrt(h)) + sqrt(p) E_l[token]) / sqrt(2)`` ``[p]``: ``x`` the (scaled) word embedding,
``W_l`` the layer's p rows of one projection ``[L·p, h]`` followed by one RMSNorm over p (one weight for every
layer), ``E_l`` the layer's own table ``[V, p]`` (the files pack the L tables as one ``[V, L·p]``). After its
MLP's residual add the layer adds ``norm_h(up(gelu_tanh(gate(y)) · u_l))`` to its output ``y``.

Parallel layout, so that each rank's cost follows its shard:

- each layer's table lives with the layer (its pipeline stage only) and is split by vocab rows over tp like the
  word embedding: partial lookups summed over tp (reduce-scattered to the sequence shards under sequence
  parallelism). A published table is the largest tensor of the model (Gemma 4 E4B: 262144 x 42·256, 2.8 billion
  values): a stage holds its layers' columns of it, over tp.
- the projection reads the word embedding, which only the first stage holds: it runs there (``[L·p, h]``, small),
  and its normalised output for every layer crosses each pipeline link beside the hidden state
  (``TransformerConfig.pipeline_width``); each stage reads its layers' columns and sends the whole on, so the
  word embedding's gradient from every layer's input returns with the hidden state's. The token ids, which
  every stage has, give each stage its own lookups.
- the per-layer gate ``[p, h]`` and up ``[h, p]`` (2·h·p per layer, about 1% of a published layer) and the norms
  are replicated over tp: they read the layer's hidden state as it is (whole, or each rank's sequence shard,
  whose partial weight gradients are then summed over tp).
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

from megand.core.sharding import MATRIX, ParamMeta, split_by_tokens, tag
from megand.core.tensor_parallel import VocabParallelEmbedding, reduce_from_tp, reduce_scatter_to_sp
from megand.core.transformer.norms import Norm


def _matrix(cfg, topo, shape, device):
    meta = ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=cfg.init_std,
                     input_split=split_by_tokens(cfg.sequence_parallel), role=MATRIX)
    return tag(torch.nn.Parameter(torch.empty(shape, dtype=cfg.params_dtype, device=device)), meta)


def _norm(cfg, topo, width, device):
    return Norm("rmsnorm", width, eps=cfg.norm_eps, input_split=split_by_tokens(cfg.sequence_parallel),
                tp_rank=topo.tp_rank, tp_size=topo.tp_size, dtype=cfg.params_dtype, device=device)



@lru_cache(maxsize=None)
def embedding_scale(width: int, dtype: torch.dtype) -> float:
    """Gemma's embedding scale sqrt(width) rounded to ``dtype``, as Gemma rounds it, as a Python number: a
    tensor made for it in the forward would be a blocking host-to-device copy on every step."""
    return torch.tensor(width ** 0.5, dtype=dtype).item()

class PerLayerProjection(torch.nn.Module):
    """The word embedding's part of every layer's input (first stage): ``x [s, b, h] -> [s, b, L·p]``, each
    layer's p columns RMS-normalised (one weight ``[p]`` for all layers)."""

    def __init__(self, cfg, topo, device):
        super().__init__()
        self.cfg = cfg
        self.weight = _matrix(cfg, topo, (cfg.per_layer_inputs_width, cfg.hidden_size), device)
        self.norm = _norm(cfg, topo, cfg.per_layer_input_size, device)

    def forward(self, x):
        y = F.linear(x, self.weight) * self.cfg.hidden_size ** -0.5
        return self.norm(y.unflatten(-1, (self.cfg.num_layers, self.cfg.per_layer_input_size))).flatten(-2)


class PerLayerInput(torch.nn.Module):
    """One layer's input embedding and the gated branch that adds it to the layer's output."""

    def __init__(self, cfg, topo, device):
        super().__init__()
        p, h = cfg.per_layer_input_size, cfg.hidden_size
        self.cfg, self.tp_group = cfg, topo.tp_group
        self.embedding = VocabParallelEmbedding(cfg.per_layer_input_vocab_size or cfg.vocab_size, p,
                                                tp_group=topo.tp_group, init_std=cfg.init_std,
                                                dtype=cfg.params_dtype, device=device)
        self.gate = _matrix(cfg, topo, (p, h), device)
        self.up = _matrix(cfg, topo, (h, p), device)
        self.norm = _norm(cfg, topo, h, device)

    def inputs(self, ids, projected):
        """``u = (projected + sqrt(p) E[ids]) / sqrt(2)`` ``[s, b, p]`` (this rank's sequence shard under sp);
        ``ids [b, s]``, ``projected`` this layer's columns of :class:`PerLayerProjection`'s output."""
        looked_up = self.embedding(ids).transpose(0, 1).contiguous()  # partial over tp: [s, b, p]
        if self.cfg.sequence_parallel:
            looked_up = reduce_scatter_to_sp(looked_up, self.tp_group)
        else:
            looked_up = reduce_from_tp(looked_up, self.tp_group)
        scale = embedding_scale(self.cfg.per_layer_input_size, looked_up.dtype)
        return (projected + looked_up * scale) * 2 ** -0.5

    def forward(self, y, ids, projected):
        """``y [s, b, h]``: the layer's output so far; returns it with the per-layer branch added."""
        gated = F.gelu(F.linear(y, self.gate), approximate="tanh") * self.inputs(ids, projected)
        return y + self.norm(F.linear(gated, self.up))
