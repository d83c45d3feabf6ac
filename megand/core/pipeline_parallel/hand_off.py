"""The hand-off between pipeline stages of different tensor-parallel widths.

With stage widths ``stage_tp`` (megand/core/parallel_layout.py), what crosses a pipeline link is still
the stage's activation ``[s, b, h]`` (or its gradient), but the two ends hold it differently: a stage
under sequence parallelism holds its tp rank's slice of the sequence (``s/tp`` rows), one without holds
the whole of it on every tp rank. Every message goes between ranks of the same (dp, cp) coordinate.

The rule, the same for activations (toward the next stage) and gradients (toward the previous one):

- the sender makes the whole tensor: an all-gather over its tp group under sequence parallelism (every
  tp rank of the stage sends the same message at the same point of its action list, so the gather is
  a collective all of them reach), else the tensor it holds;
- each rank of the receiving stage has one source: the sender whose tp index is its own modulo the
  sender's width; so each sender serves the receivers ``j`` with ``j % own width == own tp index`` and
  sends each one exactly what its layout expects: its slice of the sequence under sequence
  parallelism, else the whole tensor.

Why this rule: it is exact whatever the two widths (every receiver gets bit-identical data to what a
one-width pipeline would hand it, since the gathered tensor is the whole activation and a gradient
without sequence parallelism is the same on every tp rank), it is one rule for both directions and all
four sp/no-sp pairings, and each receiver posts one receive from one known peer, so the pipeline's
message order (p2p.py's :func:`~megand.core.pipeline_parallel.p2p.posting_order`, computed per pipeline
rank) holds unchanged: a message of the pipeline becomes, at the sender, consecutive sends to its
receivers, and at each receiver its one receive. The cost is a gather on a sequence-parallel sender and
whole-tensor messages where a receiver has no sequence parallelism (what such a stage holds anyway).
Between stages of one width and sequence parallelism the message is the plain one: no gather, one peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megand.core.parallel_layout import ParallelLayout, parse_order


class StageHandOff:
    """Rank ``rank``'s peers in every pipeline stage of ``layout`` and what it sends each one."""

    def __init__(self, layout: ParallelLayout, rank: int):
        self.layout = layout
        c = layout.coords(rank)
        self.stage, self.tp_index, self.fixed = c["pp"], c["tp"], c
        self.width = layout.stage_tp_of(self.stage)

    def stage_of(self, rank: int) -> int:
        """The pipeline rank (stage) of global rank ``rank``."""
        return self.layout.stage_of(rank)

    def _sp(self, stage: int) -> bool:
        return self.layout.stage_sp_of(stage)

    def rank_at(self, stage: int, tp_index: int) -> int:
        """The global rank of ``stage`` with tp index ``tp_index`` and this rank's cp and dp coordinates."""
        sizes = {"tp": self.layout.stage_tp_of(stage), "cp": self.layout.cp, "dp": self.layout.dp}
        coords = {**self.fixed, "tp": tp_index}
        local, stride = 0, 1
        for dim in parse_order(self.layout.order):
            if dim != "pp":
                local, stride = local + coords[dim] * stride, stride * sizes[dim]
        return self.layout.stage_offset(stage) + local

    def direct(self, stage: int) -> bool:
        """``stage`` holds its messages as this rank's stage does: one peer, the plain message."""
        return (self.layout.stage_tp_of(stage), self._sp(stage)) == (self.width, self._sp(self.stage))

    def source(self, stage: int) -> int:
        """The rank of ``stage`` this rank receives from: tp index this rank's modulo that stage's width."""
        return self.rank_at(stage, self.tp_index % self.layout.stage_tp_of(stage))

    def targets(self, stage: int) -> list[int]:
        """The ranks of ``stage`` whose source is this rank (none where that stage is narrower and this
        rank's tp index is beyond its width)."""
        return [self.rank_at(stage, j) for j in range(self.layout.stage_tp_of(stage)) if j % self.width == self.tp_index]

    def outgoing(self, tensor: torch.Tensor, stage: int, tp_group) -> list[tuple[int, torch.Tensor]]:
        """``[(receiver, message)]``: what this rank sends toward ``stage`` for its local ``tensor`` (its
        sequence slice under sequence parallelism, else the whole; see the module docstring)."""
        if self.direct(stage):
            return [(self.source(stage), tensor)]
        whole = tensor
        if self._sp(self.stage):  # collective over this stage's tp group
            whole = tensor.new_empty((tensor.shape[0] * self.width, *tensor.shape[1:]))
            dist.all_gather_into_tensor(whole, tensor.contiguous(), group=tp_group)
        width = self.layout.stage_tp_of(stage)
        return [(self.rank_at(stage, j), whole.chunk(width, dim=0)[j].contiguous() if self._sp(stage) else whole)
                for j in range(width) if j % self.width == self.tp_index]
