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
tokens and the ep group spans tp ranks. With experts split over tp (etp = tp) and sequence parallelism
(``tp_group`` given) each rank routes its sequence shard: the all-to-all over ep runs on the shard, then
the tokens that arrived are all-gathered over tp (every tp rank holds a slice of each local expert),
the experts' partial outputs are reduce-scattered back over tp, and the all-to-all returns them. Both
tp collectives have variable sizes, so they are all-to-alls too; the counts of every rank of the
(etp x ep) group are all-gathered first, so there is still one host read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megand.core.expert_parallel.combine import weighted_sum
from megand.core.expert_parallel.mappings import all_to_all
from megand.core.host_reads import even_split, host_list
from megand.core.tensor_parallel.mappings import all_gather_flat


@dataclass
class Exchange:
    """What ``unpermute`` needs to send the expert outputs back: the local sort, the split sizes."""
    order: torch.Tensor  # assignment indices in expert order (kept ones first)
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    recv_counts: list[int]  # rows received, [source rank][local expert], flattened
    kept: int  # assignments this rank sent (dropped ones are not sent)
    host_offsets: list[int]  # cumulative rows per local expert, host integers (the loop over experts)


class AllToAllDispatcher:
    """The dispatcher of an MoE block whose experts are split over the ep ranks of ``group``.

    ``bytes_sent``: token bytes this rank sent to other ranks so far (dispatch and combine, forward and
    backward); the count exchange (``E`` integers per layer and micro-batch) is not included."""

    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int, tp_group=None, tp_size: int = 1,
                 tp_rank: int = 0, tp_ep_group=None):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep_size}")
        self.num_experts, self.group, self.ep_size, self.ep_rank = num_experts, group, ep_size, ep_rank
        self.local_experts = num_experts // ep_size
        # experts split over tp (etp = tp) with sequence-parallel tokens: gather over tp after the exchange;
        # ``tp_ep_group`` lists its ranks etp fastest (row etp_rank + tp_size * ep_rank of the count matrix)
        self.tp_group, self.tp_size, self.tp_rank, self.tp_ep_group = tp_group, tp_size, tp_rank, tp_ep_group
        self.bytes_sent = 0

    def __call__(self, tokens, experts, weights, keep, local_experts):
        """The MoE block's dispatcher interface: ``tokens [T, h]`` routed to ``experts [T, k]`` with
        ``weights [T, k]`` (``keep``: the capacity mask or None) -> the routed output ``[T, h]``;
        ``local_experts(tokens, counts, offsets, host_offsets=...)`` runs this rank's experts on the grouped
        tokens (``host_offsets``: the same offsets as host integers, known here from the split sizes)."""
        grouped, counts, offsets, state = self.permute(tokens, experts, keep)
        return self.unpermute(local_experts(grouped, counts, offsets, host_offsets=state.host_offsets), state,
                              weights, keep)

    def _count_bytes(self, x: torch.Tensor, splits: list[int], me: int) -> None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        self.bytes_sent += row * (sum(splits) - splits[me])

    def _over_ep(self, x, send, recv):
        return all_to_all(x, self.group, send, recv, lambda t, s: self._count_bytes(t, s, self.ep_rank))

    def _over_tp(self, x, send, recv):
        return all_to_all(x, self.tp_group, send, recv, lambda t, s: self._count_bytes(t, s, self.tp_rank))

    def _even_counts(self) -> list[int]:
        """Every rank's assignments spread evenly over the experts: the stand-in for the counts where
        they hold no values (a rehearsal's fake tensors)."""
        return even_split(self._assignments, self.num_experts)

    def _count_matrix(self, counts):
        """``[source][expert]`` host counts: per ep rank of this rank's ep group (rows ``[ep]``), or with
        the tp gather per rank of the (etp x ep) group (rows ``[ep][tp]``); and the rows each local expert
        receives in all, summed on the device ``[E/ep]``."""
        e = self.num_experts
        lo, hi = self.ep_rank * self.local_experts, (self.ep_rank + 1) * self.local_experts
        if self.tp_group is None:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)  # [source ep rank][local expert]
            host = host_list(torch.cat([counts, received]),  # the one host read (see the module docstring)
                             lambda: self._even_counts() + self._even_counts()[lo:hi] * self.ep_size)
            mine, local = host[:e], host[e:]
            return (mine, [local[q * self.local_experts:(q + 1) * self.local_experts] for q in range(self.ep_size)],
                    None, received.view(self.ep_size, self.local_experts).sum(0))
        everyone = counts.new_empty(self.tp_size * self.ep_size * e)
        all_gather_flat(everyone, counts, group=self.tp_ep_group)
        host = host_list(everyone, lambda: self._even_counts() * (self.tp_size * self.ep_size))  # the one host read
        rows = [[host[(t + self.tp_size * q) * e:(t + self.tp_size * q + 1) * e] for t in range(self.tp_size)]
                for q in range(self.ep_size)]  # rows[q][t]: what rank (tp t, ep q) sends to each expert
        mine = rows[self.ep_rank][self.tp_rank]
        local = [[rows[q][t][lo:hi] for q in range(self.ep_size)] for t in range(self.tp_size)]  # [t][q][j]
        return mine, local[self.tp_rank], local, everyone.view(-1, e)[:, lo:hi].sum(0)

    def permute(self, x, experts, keep):
        """``x [T, h]``, ``experts [T, k]`` (global expert ids), ``keep [T, k]`` bool or None ->
        ``(tokens [R, h] grouped by local expert, counts [E/ep], offsets [E/ep] int32, state)``."""
        e, local, ep = self.num_experts, self.local_experts, self.ep_size
        k = experts.shape[1]
        flat = experts.reshape(-1)
        if keep is not None:  # dropped assignments sort last and are not sent
            flat = torch.where(keep.reshape(-1), flat, torch.full_like(flat, e))
        order = torch.sort(flat, stable=True).indices
        # per-expert counts by scatter_add (bincount would read the ids on the host to size its output)
        counts = torch.zeros(e + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))[:e]
        self._assignments = flat.numel()  # for a rehearsal's even split
        sent, from_peers, over_tp, device_counts = self._count_matrix(counts)
        recv_counts = [n for row in from_peers for n in row]  # [source ep rank][local expert]
        send = [sum(sent[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(recv_counts[r * local:(r + 1) * local]) for r in range(ep)]
        kept = sum(send)
        arrived = self._over_ep(x[order[:kept] // k], send, recv)
        # blocks [source][local expert], source = ep rank (or tp rank, ep rank after the tp gather)
        blocks = [from_peers] if over_tp is None else over_tp
        if over_tp is not None:  # every tp rank gets every tp rank's arrivals: a variable all-gather
            sizes = [sum(map(sum, rows)) for rows in over_tp]
            arrived = self._over_tp(arrived.repeat(self.tp_size, 1), [sum(recv)] * self.tp_size, sizes)
        flat_sizes = [n for rows in blocks for row in rows for n in row]
        pieces = arrived.split(flat_sizes)
        sources = len(flat_sizes) // local
        grouped = torch.cat([pieces[r * local + j] for j in range(local) for r in range(sources)])
        per_expert = [sum(flat_sizes[r * local + j] for r in range(sources)) for j in range(local)]
        # the same counts on the device, summed there from the exchanged count tensors: a host-to-device
        # copy of the host lists would block on pageable memory, twice per layer and micro-batch
        return (grouped, device_counts, torch.cumsum(device_counts, 0).to(torch.int32),
                Exchange(order, send, recv, flat_sizes, kept, list(itertools.accumulate(per_expert))))

    def unpermute(self, out, state: Exchange, weights, keep):
        """``out [R, h]`` (the local experts' outputs, grouped as ``permute`` returned them) -> ``[T, h]``:
        each token's k outputs, back on this rank, weighted and summed in a fixed order. With the tp
        gather, ``out`` holds partial sums (experts split over tp): summed over tp on the way back."""
        local = self.local_experts
        sources = len(state.recv_counts) // local
        sizes = [state.recv_counts[r * local + j] for j in range(local) for r in range(sources)]
        pieces = out[: sum(sizes)].split(sizes)  # [local expert][source]
        by_source = torch.cat([pieces[j * sources + r] for r in range(sources) for j in range(local)])
        if self.tp_group is not None:  # reduce-scatter over tp, variable sizes: send each tp rank its block
            block = sources // self.tp_size * local  # counts per source tp rank: [ep rank][local expert]
            per_tp = [sum(state.recv_counts[t * block:(t + 1) * block]) for t in range(self.tp_size)]
            mine = per_tp[self.tp_rank]
            partials = self._over_tp(by_source, per_tp, [mine] * self.tp_size)
            by_source = partials.view(self.tp_size, mine, -1).sum(0)  # fixed order: deterministic
        returned = self._over_ep(by_source, state.recv, state.send)
        t, k = weights.shape
        if state.kept < t * k:  # dropped assignments contribute nothing
            returned = torch.cat([returned, returned.new_zeros(t * k - state.kept, returned.shape[1])])
        back = torch.empty_like(returned)
        back[state.order] = returned
        w = weights if keep is None else weights.masked_fill(~keep, 0.0)
        return weighted_sum(back.view(t, k, -1), w)
