"""Cross entropy over vocab-sharded logits: the full-vocab logits are never gathered.

Each tp rank holds the logits of its vocab slice. Three all-reduces over tp (of [s, b] tensors, not
[s, b, V]) give the max, the target logit and the softmax denominator. Padding columns beyond the real
vocab are masked out, so they are never predicted.
"""

import torch
import torch.distributed as dist


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_start, vocab_size, in_place=False):
        # One fp32 copy of the local logits, shifted, exponentiated and normalised in place: it becomes
        # the softmax kept for backward. (Out of place, the fp32 logits, shifted logits and exponentials
        # are alive together: three [tokens, vocab/tp] fp32 tensors, 6 GB at 8k tokens of a 128k vocab
        # at tp=2, on top of every layer's activations.) ``in_place``: fp32 logits are that copy themselves.
        if logits.dtype != torch.float32:
            work = logits.float()
        else:
            work = logits.detach() if in_place else logits.clone()  # detached: saved as our own tensor
        local_vocab = work.shape[-1]
        real = max(0, min(local_vocab, vocab_size - vocab_start))  # a rank may hold padding only
        if real < local_vocab:
            work[..., real:] = float("-inf")

        def all_reduce(t, op=dist.ReduceOp.SUM):
            if dist.get_world_size(tp_group) > 1:
                dist.all_reduce(t, op=op, group=tp_group)

        logits_max = work.max(dim=-1).values
        all_reduce(logits_max, dist.ReduceOp.MAX)
        shifted = work.sub_(logits_max.unsqueeze(-1))

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(target_logit)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp)

        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), scaled by the incoming gradient
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None, None


class FullVocabCrossEntropy(torch.autograd.Function):
    """Cross entropy of ``[tokens, V]`` fp32 logits over the whole vocabulary, eager: torch's fused
    log-softmax forward, and a backward in place on the saved log-probabilities (``exp``, minus one at each
    target, times the incoming gradient). Autograd's own backward (``F.cross_entropy``) zero-fills a new
    ``[tokens, V]`` gradient for the NLL, then reads it and the log-probabilities into a third: at a 16k
    vocabulary that took about twice as long (and the explicit max / exp / sum / divide of
    :class:`VocabParallelCrossEntropy` reads the logits five times). Like it, it runs one backward (no
    ``retain_graph``).

    ``in_place``: the log-probabilities are written over ``logits`` (bitwise the same values), which the
    caller then never reads: no second ``[tokens, V]`` tensor. On CPU a fresh tensor of that size (64 MB at
    1024 tokens of a 16k vocabulary) is memory the kernel maps and zeroes page by page at its first write:
    the log-softmax into one took 3-6x the time of the same kernel over the logits' pages, already mapped
    by the output layer's product."""

    @staticmethod
    def forward(ctx, logits, target, in_place=False):
        # detached: saved for backward as this function's own tensor, not as its input (a view the output
        # layer made, which autograd would refuse to hand back once written over)
        log_probs = torch.log_softmax(logits, dim=-1, out=logits.detach()) if in_place else torch.log_softmax(logits, dim=-1)
        target = target.unsqueeze(-1)
        ctx.save_for_backward(log_probs, target)
        return log_probs.gather(-1, target).squeeze(-1).neg_()

    @staticmethod
    def backward(ctx, grad_loss):
        log_probs, target = ctx.saved_tensors
        grad = log_probs.exp_()  # the softmax, minus one at the target, times the token's incoming gradient
        grad.scatter_add_(-1, target, torch.full(target.shape, -1.0, dtype=grad.dtype, device=grad.device))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def full_vocab_cross_entropy(logits, target, vocab_size: int, consume: bool = False):
    """Per-token loss ``[...]`` from logits over the whole vocabulary ``[..., V]`` (padding columns past
    ``vocab_size`` cut off), without the all-reduces of the vocab-parallel path (:class:`FullVocabCrossEntropy`).
    Compiling it gains nothing over this (measured at a 16k vocabulary on one CPU thread): it stays eager.
    ``consume``: as :func:`vocab_parallel_cross_entropy`."""
    full = logits[..., :vocab_size].float().reshape(-1, vocab_size)
    # a copy made here (another dtype, padding cut off) is this function's own to overwrite in any case
    own = consume or full.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    return FullVocabCrossEntropy.apply(full, target.reshape(-1), own).view(target.shape)


def vocab_parallel_cross_entropy(logits, target, tp_group, vocab_start: int, vocab_size: int, consume: bool = False):
    """Per-token loss ``[...]`` from local logits ``[..., V_local]`` and global target ids ``[...]``.

    ``consume``: the caller hands over ``logits`` and never reads them again (the model's own logits,
    which nothing else saved for backward: autograd would refuse the backward of an operator that did):
    fp32 logits are then worked on in place instead of copied, and hold the softmax for backward."""
    if dist.get_world_size(tp_group) == 1:
        return full_vocab_cross_entropy(logits, target, vocab_size, consume)
    return VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_start, vocab_size, consume)
