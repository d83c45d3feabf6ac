"""ZeRO-3 parameter all-gathers in FP8: a bucket of FP8 layers' weights is gathered as the FP8 operands the
layers' GEMMs take (bytes plus scales) instead of the high-precision parameters, half the bytes of bf16.

Each rank quantises its own slice of the bucket with scales that equal the ones the one-process run computes
on the whole weight (dynamic scaling: the amax of the current weight, see :mod:`..tensor_parallel.fp8`):

- ``tensorwise`` and ``rowwise``: every rank takes the amax of its part of each scale's group (a weight, or
  a row of it), the amaxes are agreed by one all-reduce (max) over the shard group, then over the tensor-
  parallel group where the layer's recipe agrees them there; each rank quantises its slice with the agreed
  scales and the FP8 bytes are all-gathered.
- ``mxfp8``: the weights are laid out so that every 32-element block lies in one rank's slice (offsets
  and slices multiples of 32, rows of a multiple of 32): each rank computes its blocks' e8m0 scales
  itself and they travel with the bytes (one byte per block), no agreement needed.

The gathered operands are handed to each layer's :class:`~megand.core.tensor_parallel.fp8.Fp8Policy`
(``policy.gathered``, keyed by the view of the weight a GEMM reads), which uses them in place of quantising
the weight. Master weights stay in the parameter buffer, high precision, as without FP8.

Which operand a phase needs: forward scales run along the input features (``k``); the input gradient's
along the output features (``n``). Tensorwise has one scale whatever the axis, so backward gathers FP8
too (the forward's bytes when the layer runs one GEMM on the whole weight; a fused SwiGLU fc1 runs one
per gate and up rows, so its backward operand, scaled over the whole weight, is gathered on its own).
Rowwise and MX scale the input gradient's weight operand along ``n``: backward gathers the high-precision
weight, as without FP8, and the layer quantises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megand.core.tensor_parallel.fp8 import Quantized
from megand.core.tensor_parallel.fp8_recipes import fp8_recipe
from megand.core.tensor_parallel.fp8_recipes.mxfp8 import mx_scale
from megand.core.tensor_parallel.fp8_recipes.scaling import _TINY, E4M3, fmax
from megand.core.tensor_parallel.mappings import all_gather_flat

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class Fp8Weight:
    """One FP8 layer's weight ``[n, k]`` in a bucket: ``start`` its offset in the bucket; ``parts``: the
    forward runs one GEMM per part of interleaved rows (row ``r`` in part ``r % parts``)."""

    param: torch.nn.Parameter
    policy: object
    parts: int
    start: int

    @property
    def n(self) -> int:
        return self.param.shape[0]

    @property
    def k(self) -> int:
        return self.param.shape[1]


def view_key(start: int, stride, shape, dim: int) -> tuple:
    """How :class:`~megand.core.tensor_parallel.fp8.Fp8Policy` finds a gathered operand: the weight view's
    storage offset in the bucket, strides, shape and the axis its scales run along."""
    return start, tuple(stride), tuple(shape), dim


def _rows(piece: torch.Tensor, a: int, b: int, k: int):
    """Elements ``[a, b)`` of a flattened ``[n, k]`` weight as whole rows ``[r0, r1)`` (zeros around)."""
    r0, r1 = a // k, -(-b // k)
    rows = piece.new_zeros((r1 - r0) * k, dtype=torch.float32)
    rows[a - r0 * k: b - r0 * k] = piece
    return r0, rows.view(r1 - r0, k)


class _Pending:
    """An FP8 gather in flight: ``wait()`` waits for the bytes, then hands the operands to the layers."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        if self.work is not None:
            self.work.wait()
        self.finish()


class BucketFp8Gather:
    """The FP8 all-gathers of one bucket holding only FP8 layers' weights (see the module docstring)."""

    def __init__(self, bucket, weights: list[Fp8Weight], recipe: str):
        self.bucket, self.weights, self.recipe = bucket, weights, recipe
        self.record = rec = fp8_recipe(recipe)
        self.formats = set()  # phases whose operands are gathered now
        self.nbytes = 0  # bytes held by the gathered operands
        # one phase's bytes serve the other when every weight's one forward GEMM reads all of it
        self._forward_serves_backward = rec.one_scale and all(w.parts == 1 for w in weights)
        if rec.blocked:
            misaligned = [w for w in weights if w.start % rec.block or w.k % rec.block]
            if misaligned or (bucket.shard_end - bucket.shard_start) % rec.block:
                raise ValueError(f"{recipe} gathers need {rec.block}-aligned weights and slices")
        self._groups = {phase: self._group_layout(phase) for phase in (FORWARD, BACKWARD)}

    # -- which phase needs what -------------------------------------------------------------------
    def gathers(self, phase: str) -> bool:
        """Whether ``phase`` gathers FP8 (else the high-precision weights)."""
        return phase == FORWARD or self.record.one_scale

    def serves(self, phase: str) -> bool:
        """Whether the operands gathered now include ``phase``'s."""
        return phase in self.formats or (bool(self.formats) and self._forward_serves_backward)

    # -- scale groups (one scale, per row: agreed amaxes) ------------------------------------------
    def _groups_of(self, w: Fp8Weight, phase: str) -> int:
        if phase == BACKWARD:
            return 1  # one scale over the whole weight
        return w.n if self.record.per_row else w.parts

    def _agrees_over_tp(self, w: Fp8Weight, phase: str) -> bool:
        """The recipe's own rule (Fp8Policy._q, the record's ``agrees``): a scale of the whole weight when
        it is split, a row's when the contraction axis (``k`` here) is split."""
        return self.record.agrees(w.policy.sharded, "nk", "k")

    def _group_layout(self, phase):
        """``{weight index: first group}`` in one amax vector, the groups agreed over tp first, their count,
        and the total."""
        if self.record.blocked or not self.gathers(phase):
            return None
        base, cursor = {}, 0
        order = sorted(range(len(self.weights)), key=lambda j: not self._agrees_over_tp(self.weights[j], phase))
        tp_groups = 0
        for j in order:
            base[j] = cursor
            cursor += self._groups_of(self.weights[j], phase)
            if self._agrees_over_tp(self.weights[j], phase):
                tp_groups = cursor
        groups = {id(w.policy.group) for w in self.weights if self._agrees_over_tp(w, phase)}
        if len(groups) > 1:
            raise ValueError("one bucket's FP8 weights belong to different tensor-parallel groups")
        tp_group = next(w.policy.group for w in self.weights if self._agrees_over_tp(w, phase)) if groups else None
        return base, tp_groups, cursor, tp_group

    def _pieces(self):
        """``(weight index, piece, a, b, position in the slice)``: this rank's elements ``[a, b)`` of each
        weight's flattening."""
        b = self.bucket
        shard = b.data_shard
        lo_s, hi_s = b.shard_start - b.start, b.shard_end - b.start
        for j, w in enumerate(self.weights):
            lo, hi = max(w.start, lo_s), min(w.start + w.param.numel(), hi_s)
            if lo < hi:
                yield j, shard[lo - lo_s: hi - lo_s], lo - w.start, hi - w.start, lo - lo_s

    def _row_scales(self, j, phase, scales, r0, rows):
        """The scale of each of ``rows`` (starting at row ``r0`` of weight ``j``) under ``phase``."""
        w, base = self.weights[j], self._groups[phase][0][j]
        if phase == BACKWARD:
            return scales[base].expand(rows)
        if self.record.per_row:
            return scales[base + r0: base + r0 + rows]
        return scales[base + (torch.arange(r0, r0 + rows, device=scales.device) % w.parts)]

    def _quantize_slice(self, phase, engine):
        """This rank's slice of the bucket in FP8 (uint8 bytes), and the scales every rank now agrees on."""
        b = self.bucket
        reduce = b.buffer.reduce
        out = torch.zeros(b.shard_end - b.shard_start, dtype=torch.uint8, device=b.data_shard.device)
        limit = fmax(E4M3)
        if self.record.blocked:  # each block's scale its own, travelling with the bytes
            blocks = b.data_shard.float().view(-1, self.record.block)
            scale = mx_scale(blocks.abs().amax(dim=1), E4M3)
            out.copy_((blocks / scale[:, None]).clamp(-limit, limit).to(E4M3).view(-1).view(torch.uint8))
            exponent = (torch.frexp(scale)[1] - 1 + 127).to(torch.uint8)  # e8m0: the biased exponent
            return torch.cat([out, exponent]), None
        base, tp_groups, total, tp_group = self._groups[phase]
        amax = torch.zeros(total, dtype=torch.float32, device=out.device)
        pieces = []
        for j, piece, a, z, pos in self._pieces():
            w = self.weights[j]
            r0, rows = _rows(piece, a, z, w.k)
            pieces.append((j, a, z, pos, r0, rows))
            if phase == BACKWARD:
                amax[base[j]] = rows.abs().amax()
                continue
            row_amax = rows.abs().amax(dim=1)
            if self.record.per_row:
                amax[base[j] + r0: base[j] + r0 + len(row_amax)] = row_amax
            else:
                for part in range(w.parts):
                    mine = row_amax[(part - r0) % w.parts:: w.parts]
                    if mine.numel():
                        amax[base[j] + part] = mine.max()
        engine.count("all_reduce", amax, reduce.size)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=reduce.group)
        if tp_groups and dist.get_world_size(tp_group) > 1:
            agreed = amax[:tp_groups].contiguous()
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=tp_group)
            amax[:tp_groups] = agreed
        scales = amax.clamp(min=_TINY) / limit  # as quantize(): the same fp32 operations, the same scales
        for j, a, z, pos, r0, rows in pieces:
            row_scale = self._row_scales(j, phase, scales, r0, rows.shape[0])
            q = (rows / row_scale[:, None]).clamp(-limit, limit).to(E4M3).view(-1)
            out[pos: pos + z - a] = q[a - r0 * rows.shape[1]: z - r0 * rows.shape[1]].view(torch.uint8)
        return out, scales

    def start(self, phase: str, engine) -> _Pending:
        """Quantise this rank's slice for ``phase`` and start gathering it (asynchronously)."""
        b = self.bucket
        reduce = b.buffer.reduce
        mine, scales = self._quantize_slice(phase, engine)
        full = torch.empty(mine.numel() * reduce.size, dtype=torch.uint8, device=mine.device)
        engine.count("all_gather", full, reduce.size)
        work = all_gather_flat(full, mine, group=reduce.group, async_op=True)
        self.formats.add(phase)
        return _Pending(work, lambda: self._install(phase, full, scales))

    def _install(self, phase, full, scales):
        """Hand the gathered operands to the layers' policies."""
        if phase not in self.formats:  # released before it was waited for
            return
        self.nbytes += full.numel()
        b = self.bucket
        rec = self.record
        if rec.blocked:
            per_rank = full.view(b.buffer.reduce.size, -1)
            slice_len = b.shard_end - b.shard_start
            data = per_rank[:, :slice_len].reshape(-1)
            exponent = per_rank[:, slice_len:].reshape(-1).float() - 127
            block_scales = torch.ldexp(torch.ones_like(exponent), exponent)
        else:
            data = full
        base = self._groups[phase][0] if self._groups[phase] else None
        for j, w in enumerate(self.weights):
            weight = data[w.start: w.start + w.param.numel()].view(E4M3).view(w.n, w.k)
            policy = w.policy
            if phase == BACKWARD or (rec.one_scale and w.parts == 1):
                whole = Quantized(weight, scales[base[j]], 0, self.recipe)  # one scale over the whole weight
                policy.gathered[view_key(w.start, (w.k, 1), (w.n, w.k), 0)] = whole
            if phase == BACKWARD and w.parts > 1:
                continue
            if rec.blocked:
                start = w.start // rec.block
                all_scales = block_scales[start: start + w.param.numel() // rec.block].view(w.n, w.k // rec.block)
            for part in range(w.parts):
                rows = weight[part:: w.parts]
                if rec.one_scale:
                    scale = scales[base[j] + part]
                elif rec.per_row:
                    scale = scales[base[j]: base[j] + w.n][part:: w.parts].view(-1, 1)
                else:
                    scale = all_scales[part:: w.parts]
                key = view_key(w.start + part * w.k, (w.parts * w.k, 1), rows.shape, 1)
                policy.gathered[key] = Quantized(rows, scale, 1, self.recipe)

    def clear(self):
        """Drop the gathered operands (the bucket is freed)."""
        self.formats.clear()
        self.nbytes = 0
        for w in self.weights:
            w.policy.gathered.clear()
