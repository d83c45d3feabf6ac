"""Multi-token prediction (DeepSeek-V3's MTP module), on the last pipeline stage.

Depth k (1-based) predicts the token k+1 ahead of each position: it normalises the previous depth's output
(for k = 1 the main model's output after its final norm, the input of the output layer) and the embedding of
the token k ahead (the word embedding shared with the main model: no position embedding), concatenates them
``[embedding, hidden]``, projects ``2h -> h`` and runs one transformer layer of its own, then a norm of its
own. That normalised output goes through the main model's output layer (shared) and on to depth k + 1; its
loss is on the labels shifted by k (the tokens k+1 ahead). (This is how DeepSeek-V3's published MTP weights
are used by Megatron-LM's and transformers' implementations: each depth reads the normalised hidden state the
output layer reads; its ``eh_proj`` takes the embedding half first.) The inputs need no token from outside the sequence: the token k ahead of position t is
``labels[t + k - 1]``, and positions within k of the end have no target (their loss is zero).

Under tensor parallelism the projection is column-parallel and its output gathered over tp (Megatron's
choice); under sequence parallelism every tensor here is this rank's sequence shard, as in the layers.
"""

import torch

from megand.core.sharding import split_by_tokens
from megand.core.tensor_parallel import ColumnParallelLinear, gather_from_tp, scatter_to_sp
from megand.core.transformer import TransformerLayer
from megand.core.transformer.norms import Norm


class MTPDepth(torch.nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``proj`` (2h -> h), ``layer`` and ``final_norm``."""

    def __init__(self, cfg, topo, rng, device, layer_id: int):
        super().__init__()
        self.cfg, self.tp_group = cfg, topo.tp_group
        norm = dict(eps=cfg.norm_eps, input_split=split_by_tokens(cfg.sequence_parallel), tp_rank=topo.tp_rank,
                    tp_size=topo.tp_size, dtype=cfg.params_dtype, device=device, unit_offset=cfg.norm_unit_offset)
        self.enorm = Norm(cfg.norm, cfg.hidden_size, **norm)
        self.hnorm = Norm(cfg.norm, cfg.hidden_size, **norm)
        self.proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, tp_group=topo.tp_group, bias=False,
                                         sequence_parallel=cfg.sequence_parallel, init_std=cfg.init_std,
                                         dtype=cfg.params_dtype, device=device)
        self.layer = TransformerLayer(cfg, topo, rng, device, layer_id=layer_id)
        self.final_norm = Norm(cfg.norm, cfg.hidden_size, **norm)

    def forward(self, hidden, embedded, rope, documents):
        """``hidden``: the previous depth's normalised output, ``embedded``: the tokens k ahead, both ``[s, b, h]``
        (the sequence shard under sp). Returns this depth's normalised output (for the logits and the next
        depth)."""
        x = self.proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [s, b, h/tp] (full s)
        x = gather_from_tp(x, self.tp_group)
        if self.cfg.sequence_parallel:
            x = scatter_to_sp(x, self.tp_group)
        return self.final_norm(self.layer(x, rope, None, documents))


class MultiTokenPrediction(torch.nn.Module):
    """``model.mtp_layers`` depths after the main model; parameters ``mtp.<k-1>.*``. Its transformer layers
    take the global indices after the main model's (``num_layers + k - 1``: MoE or dense by the same rule)."""

    def __init__(self, cfg, topo, rng, device):
        super().__init__()
        self.depths = torch.nn.ModuleList([MTPDepth(cfg, topo, rng, device, cfg.num_layers + k)
                                           for k in range(cfg.mtp_layers)])

    def forward(self, hidden, labels, embed, rope, documents):
        """``hidden``: the main model's output after its final norm ``[s, b, h]``; ``labels [b, s]``;
        ``embed(ids [b, s])`` the shared word embedding ``-> [s, b, h]``. Returns each depth's normalised output."""
        outputs = []
        for k, depth in enumerate(self.depths, start=1):
            hidden = depth(hidden, embed(shift_left(labels, k - 1)), rope, documents)
            outputs.append(hidden)
        return outputs


def shift_left(labels, k: int, fill: int = 0):
    """``labels [b, s]`` moved ``k`` positions to the left, the last ``k`` filled with ``fill``."""
    if k == 0:
        return labels
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], k), fill)], dim=1)


def depth_losses(per_token, k: int):
    """Depth ``k``'s per-token loss ``[b, s]`` (position t predicting ``labels[t + k]``), put at the position
    of its target's label: entry j holds the loss of the token ``labels[j]`` (zero for j < k), so the main
    loss's mask (``data.eod_mask_loss``) applies to it as it is."""
    b, s = per_token.shape
    return torch.cat([per_token.new_zeros(b, k), per_token[:, : s - k]], dim=1)
