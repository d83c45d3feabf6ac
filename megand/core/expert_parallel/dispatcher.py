"""Token dispatch over the expert-parallel group: all-to-all out to the experts' ranks and back.

The routed experts of a layer are split evenly over the ep ranks (rank r holds experts
``[r * E/ep, (r + 1) * E/ep)``). For one micro-batch:

1. ``permute``: sort this rank's (kept) assignments by expert, exchange the per-expert counts (one small
   all-to-all of ``E`` integers), read them on the host, exchange the tokens with those split sizes, and
   regroup what arrived from ``[source rank][local expert]`` into ``[local expert][source rank]`` order:
   the grouped-GEMM layout of the local experts.
2. the local experts run on the grouped tokens.
3. ``unpermute``: undo the regrouping, send every output back to the rank that routed the token, put the
   outputs back in assignment order and sum each token's k outputs times their routing weights.

The host read in step 1 is unavoidable with variable splits: ``all_to_all_single`` takes its split sizes
as host integers, so each MoE layer reads its count matrix once per micro-batch and direction of the
forward (the backward reuses the forward's sizes). It is the only host read expert parallelism adds.

Under tensor parallelism the tokens a rank hands to the dispatcher are its own (Megatron's all-to-all
dispatcher): with whole experts per tp rank (etp = 1) each tp rank routes its share of the tp group's
tokens and the ep group spans tp ranks; with experts split over tp (etp = tp) the ep peers have the same
tp rank and the MoE block sums the experts' partial outputs over tp around the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megand.core.expert_parallel.mappings import all_to_all


@dataclass
class Exchange:
    """What ``unpermute`` needs to send the expert outputs back: the local sort, the split sizes."""
    order: torch.Tensor  # assignment indices in expert order (kept ones first)
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    recv_counts: list[int]  # rows received, [source rank][local expert], flattened
    kept: int  # assignments this rank sent (dropped ones are not sent)


class AllToAllDispatcher:
    """The dispatcher of an MoE block whose experts are split over the ep ranks of ``group``.

    ``bytes_sent``: token bytes this rank sent to other ranks so far (dispatch and combine, forward and
    backward); the count exchange (``E`` integers per layer and micro-batch) is not included."""

    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep_size}")
        self.num_experts, self.group, self.ep_size, self.ep_rank = num_experts, group, ep_size, ep_rank
        self.local_experts = num_experts // ep_size
        self.bytes_sent = 0

    def _count_bytes(self, x: torch.Tensor, splits: list[int]) -> None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        self.bytes_sent += row * (sum(splits) - splits[self.ep_rank])

    def permute(self, x, experts, keep):
        """``x [T, h]``, ``experts [T, k]`` (global expert ids), ``keep [T, k]`` bool or None ->
        ``(tokens [R, h] grouped by local expert, counts [E/ep], offsets [E/ep] int32, state)``."""
        e, local, ep = self.num_experts, self.local_experts, self.ep_size
        k = experts.shape[1]
        flat = experts.reshape(-1)
        if keep is not None:  # dropped assignments sort last and are not sent
            flat = torch.where(keep.reshape(-1), flat, torch.full_like(flat, e))
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=e + 1)[:e]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank][local expert]
        host = torch.cat([counts, received]).tolist()  # the one host read (see the module docstring)
        sent, recv_counts = host[:e], host[e:]
        send = [sum(sent[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(recv_counts[r * local:(r + 1) * local]) for r in range(ep)]
        kept = sum(send)
        arrived = all_to_all(x[order[:kept] // k], self.group, send, recv, self._count_bytes)
        pieces = arrived.split(recv_counts)
        grouped = torch.cat([pieces[r * local + j] for j in range(local) for r in range(ep)])
        per_expert = [sum(recv_counts[r * local + j] for r in range(ep)) for j in range(local)]
        offsets = torch.tensor(per_expert, dtype=torch.int64).cumsum(0).to(torch.int32)
        return (grouped, torch.tensor(per_expert, device=x.device), offsets.to(x.device),
                Exchange(order, send, recv, recv_counts, kept))

    def unpermute(self, out, state: Exchange, weights, keep):
        """``out [R, h]`` (the local experts' outputs, grouped as ``permute`` returned them) -> ``[T, h]``:
        each token's k outputs, back on this rank, weighted and summed in a fixed order."""
        local, ep = self.local_experts, self.ep_size
        sizes = [state.recv_counts[r * local + j] for j in range(local) for r in range(ep)]
        pieces = out[: sum(sizes)].split(sizes)  # [local expert][source rank]
        by_rank = torch.cat([pieces[j * ep + r] for r in range(ep) for j in range(local)])
        returned = all_to_all(by_rank, self.group, state.recv, state.send, self._count_bytes)
        t, k = weights.shape
        if state.kept < t * k:  # dropped assignments contribute nothing
            returned = torch.cat([returned, returned.new_zeros(t * k - state.kept, returned.shape[1])])
        back = torch.empty_like(returned)
        back[state.order] = returned
        w = weights if keep is None else weights.masked_fill(~keep, 0.0)
        return (back.view(t, k, -1).float() * w.unsqueeze(-1)).sum(1).to(out.dtype)
