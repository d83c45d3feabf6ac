"""The attention of one (query block, K/V block) pair for the context-parallel variants, on a fused kernel.

Ring and all-gather attention split the work into blocks and merge the blocks' outputs by their
log-sum-exp; backward recomputes each block from the *final* output and log-sum-exp of the whole
attention. Two implementations of that contract:

- :class:`ExplicitBlocks`: the fp32 math of :func:`block_forward` / :func:`block_backward` (one score
  block in memory). The CPU path, every fp32 run, and the reference.
- :class:`FusedBlocks`: a flash-attention kernel in the model's dtype (bf16/fp16, tensor cores, no score
  block in memory): its forward returns the block's log-sum-exp and its backward takes the final output
  and log-sum-exp, as torch's own context parallelism uses them. GQA runs natively (k/v keep their
  groups). A causal block that is not square (more keys than queries, diagonal at the bottom-right) is
  split into the fully visible keys and a square causal block, so the kernel's alignment of non-square
  causal masks never matters. Blocks with a document mask stay on the explicit math (flash kernels
  take no arbitrary mask).

:func:`blocks_for` makes the choice once per attention call from the tensors' device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


FUSED_DTYPES = (torch.bfloat16, torch.float16)

# ---------------------------------------------------------------- explicit fp32 math (the reference)


def _scores(q, k, scale, causal, allowed=None):
    """Scaled scores of q [b, nh, sq, d] against k [b, ng, sk, d] as [b, ng, nh/ng*sq, sk].

    ``causal`` masks with the diagonal aligned to the bottom-right corner: query i sees key j iff
    j <= i + sk - sq (the last query is the last key's token).
    """
    b, nh, sq, d = q.shape
    ng, sk = k.shape[1], k.shape[2]
    scores = torch.matmul(q.reshape(b, ng, nh // ng * sq, d), k.transpose(-1, -2)).mul_(scale)
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(sk - sq + 1)
        scores.view(b, ng, nh // ng, sq, sk).masked_fill_(future, float("-inf"))
    if allowed is not None:  # [b, sq, sk] document mask
        scores.view(b, ng, nh // ng, sq, sk).masked_fill_(~allowed[:, None, None], float("-inf"))
    return scores


def block_forward(q, k, v, scale, causal, allowed=None):
    """Attention of q over one K/V block: (out [b, nh, sq, d], lse [b, nh, sq]). Without ``allowed`` every
    query must see a key; with it, a row that sees none gives out 0 and lse -inf."""
    b, nh, sq, d = q.shape
    scores = _scores(q, k, scale, causal, allowed)
    row_max = scores.amax(dim=-1, keepdim=True)
    if allowed is not None:
        row_max.masked_fill_(row_max == float("-inf"), 0.0)
    unnormalised = scores.sub_(row_max).exp_()  # in place: one score-sized buffer, one exp pass
    row_sum = unnormalised.sum(dim=-1, keepdim=True)
    out = torch.matmul(unnormalised, v).div_(row_sum if allowed is None else row_sum.clamp_min(1e-30))
    lse = row_max.add_(row_sum.log_()).squeeze(-1)
    return out.view(b, nh, sq, d), lse.view(b, nh, sq)


def block_backward(dout, q, k, v, lse, delta, scale, causal, allowed=None):
    """(dq, dk, dv) of one block, from the *final* lse and delta = rowsum(dout * out) of the whole attention."""
    b, nh, sq, d = q.shape
    ng = k.shape[1]
    probs = _scores(q, k, scale, causal, allowed).sub_(lse.reshape(b, ng, -1, 1)).exp_()
    dout = dout.reshape(b, ng, -1, d)
    dv = torch.matmul(probs.transpose(-1, -2), dout)  # the matmul also sums over the nh/ng heads of a group
    dscores = torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.reshape(b, ng, -1, 1)).mul_(probs).mul_(scale)
    dq = torch.matmul(dscores, k).view(b, nh, sq, d)
    dk = torch.matmul(dscores.transpose(-1, -2), q.reshape(b, ng, -1, d))
    return dq, dk, dv





class ExplicitBlocks:
    """fp32 explicit math (``block_forward`` / ``block_backward``)."""

    fused = False

    @staticmethod
    def prepare(t: torch.Tensor) -> torch.Tensor:
        """The form the blocks compute on: fp32."""
        return t.float()

    @staticmethod
    def forward(q, k, v, scale, causal, allowed=None):
        """``(out fp32 [b, nh, sq, d], lse fp32 [b, nh, sq])`` of q over one K/V block."""
        return block_forward(q.float(), k.float(), v.float(), scale, causal, allowed)

    @staticmethod
    def backward(dout, q, k, v, out, lse, delta, scale, causal, allowed=None):
        """fp32 ``(dq, dk, dv)`` of one block, from the final ``out``/``lse`` and ``delta = rowsum(dout * out)``."""
        return block_backward(dout.float(), q.float(), k.float(), v.float(), lse, delta, scale, causal, allowed)


@dataclass(frozen=True)
class FlashOps:
    """A flash-attention forward that returns the log-sum-exp and the backward that takes the final one:
    ``forward(q, k, v, causal, scale) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, causal, scale)
    -> (dq, dk, dv)``, on ``[b, heads, s, d]`` tensors (k/v may have fewer, grouped, heads)."""
    forward: Callable
    backward: Callable


def _cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    # no dropout: the random state and the (varlen-only) cumulative lengths are not read
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq, dk, dv


CUDA_FLASH = FlashOps(_cuda_flash_forward, _cuda_flash_backward)


def _cpu_flash_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


# CPU's flash kernel has the same contract: it lets the fused path be tested against the math on CPU
# (the CPU path itself stays on the explicit math)
CPU_FLASH = FlashOps(_cpu_flash_forward, _cpu_flash_backward)


def _split_causal(sq: int, sk: int, causal: bool):
    """``[(key slice, causal)]`` covering the keys of a block with the diagonal at the bottom-right: with
    more keys than queries, the first ``sk - sq`` keys are seen by every query (no mask) and the last ``sq``
    form a square causal block."""
    if not causal or sk == sq:
        return [(slice(None), causal)]
    if sk < sq:
        raise ValueError(f"a causal block needs at least as many keys as queries; got {sq} queries, {sk} keys")
    return [(slice(0, sk - sq), False), (slice(sk - sq, None), True)]


class FusedBlocks:
    """Blocks on a flash kernel (``ops``) in the input dtype; outputs merged and returned in fp32."""

    fused = True

    def __init__(self, ops: FlashOps):
        self.ops = ops

    @staticmethod
    def prepare(t: torch.Tensor) -> torch.Tensor:
        """The form the blocks compute on: the input dtype, unchanged."""
        return t

    def forward(self, q, k, v, scale, causal, allowed=None):
        if allowed is not None:
            return ExplicitBlocks.forward(q, k, v, scale, causal, allowed)
        out = lse = None
        for ks, square_causal in _split_causal(q.shape[2], k.shape[2], causal):
            block_out, block_lse = self.ops.forward(q, k[:, :, ks], v[:, :, ks], square_causal, scale)
            block_out, block_lse = block_out.float(), block_lse.float()
            if out is None:
                out, lse = block_out, block_lse
            else:
                new_lse = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
                lse = new_lse
        return out, lse

    def backward(self, dout, q, k, v, out, lse, delta, scale, causal, allowed=None):
        if allowed is not None:
            return ExplicitBlocks.backward(dout, q, k, v, out, lse, delta, scale, causal, allowed)
        out, lse = out.to(q.dtype), lse.float().contiguous()
        dq, dks, dvs = None, [], []
        for ks, square_causal in _split_causal(q.shape[2], k.shape[2], causal):
            block_dq, block_dk, block_dv = self.ops.backward(dout, q, k[:, :, ks], v[:, :, ks], out, lse,
                                                             square_causal, scale)
            dq = block_dq.float() if dq is None else dq + block_dq.float()
            dks.append(block_dk.float())
            dvs.append(block_dv.float())
        return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


def flash_supported(q: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel takes these blocks: a CUDA tensor in bf16/fp16, head dim a multiple of
    8 up to 256."""
    d = q.shape[-1]
    return q.device.type == "cuda" and q.dtype in FUSED_DTYPES and d % 8 == 0 and d <= 256


def blocks_for(q: torch.Tensor):
    """The block implementation for an attention call on ``q``: fused flash kernels on CUDA in bf16/fp16,
    the explicit fp32 math otherwise (CPU, fp32)."""
    return FusedBlocks(CUDA_FLASH) if flash_supported(q) else ExplicitBlocks()
