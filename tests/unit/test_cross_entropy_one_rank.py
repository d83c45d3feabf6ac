"""At tp=1 the loss takes a one-rank cross entropy (torch's fused log-softmax, a backward in place): the same
per-token loss and logits gradient as the vocab-parallel math, padding columns (logits wider than the vocabulary) never predicted nor given a gradient."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megand.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)


def test_one_rank_matches_the_vocab_parallel_math(one_process_world):  # noqa: F811
    from megand.core.parallel_state import init_distributed

    init_distributed()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    for vocab, width in ((13, 13), (13, 16)):  # unpadded; padded (3 columns the model never predicts)
        logits = torch.randn(6, 3, width, generator=gen, dtype=torch.float64) * 3
        logits[..., vocab:] = 1e4  # huge: must be cut off
        target = torch.randint(0, vocab, (6, 3), generator=gen)
        grad = torch.rand(6, 3, generator=gen, dtype=torch.float64)
        mine, ref = logits.clone().requires_grad_(), logits[..., :vocab].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, group, 0, vocab)
        expected = VocabParallelCrossEntropy.apply(ref, target, group, 0, vocab)
        torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=1e-6, atol=1e-6)
        (loss * grad).sum().backward()
        (expected * grad).sum().backward()
        torch.testing.assert_close(mine.grad[..., :vocab], ref.grad.to(mine.grad.dtype), rtol=1e-6, atol=1e-6)
        assert not mine.grad[..., vocab:].any()


def test_vocab_parallel_forward_keeps_one_fp32_copy_of_the_logits(one_process_world):  # noqa: F811
    """The softmax kept for backward is the one fp32 copy: the fp32 logits, shifted logits and
    exponentials are not alive together (three [tokens, vocab/tp] fp32 tensors: 6 GB on a llama 3 8B
    rank at tp=2 and 8k tokens, at the moment every layer's activations are held)."""
    from megand.core.parallel_state import init_distributed
    from megand.tools.rehearse import LiveBytes

    init_distributed()
    logits = torch.randn(64, 2, 1000, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (64, 2))
    fp32_copy = logits.numel() * 4
    with LiveBytes() as tracker:
        loss = VocabParallelCrossEntropy.apply(logits, target, dist.group.WORLD, 0, 1000)
        peak = tracker.peak - logits.numel() * 2  # the input is counted when first seen
    assert fp32_copy <= peak <= fp32_copy * 1.05, (peak, fp32_copy)
    loss.sum().backward()
    reference = torch.nn.functional.cross_entropy(logits.detach().float().view(-1, 1000), target.view(-1),
                                                  reduction="none").view(64, 2)
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


def test_one_rank_backward_makes_no_new_logits_sized_tensor(one_process_world):  # noqa: F811
    """The one-rank backward works in place on the saved log-probabilities: no logits-sized tensor is made
    in backward (autograd's ``F.cross_entropy`` makes two, a zero-filled NLL gradient and the log-softmax's
    gradient: twice the time at a 16k vocabulary), and the loss and gradient are ``F.cross_entropy``'s."""
    from megand.core.parallel_state import init_distributed
    from megand.tools.rehearse import LiveBytes

    init_distributed()
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 2, 1000, generator=gen) * 3).requires_grad_()
    target = torch.randint(0, 1000, (64, 2), generator=gen)
    grad = torch.rand(64, 2, generator=gen)
    one_copy = logits.numel() * 4
    with LiveBytes() as tracker:
        loss = vocab_parallel_cross_entropy(logits, target, dist.group.WORLD, 0, 1000)
        loss.backward(grad)
    # the logits (counted when first seen) and the log-probabilities saved for backward, which become the gradient
    assert tracker.peak <= 2 * one_copy * 1.05, (tracker.peak, one_copy)
    ref = logits.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(ref.view(-1, 1000), target.view(-1), reduction="none").view(64, 2)
    expected.backward(grad)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-6, atol=1e-7)


class _LogitsSized(TorchDispatchMode):
    """How many tensors of ``numel`` elements the operators return (the logits, the log-probabilities...)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = isinstance(out, torch.Tensor) and not any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values()))
        if fresh and out.numel() == self.numel:
            self.made.append(str(func))
        return out


def test_the_models_loss_writes_the_log_probabilities_over_its_logits(one_process_world):  # noqa: F811
    """At tp=1 in fp32 the model's loss forward makes one ``[tokens, V]`` tensor, the logits: the
    log-probabilities are written over them (the model never reads its logits again), where a fresh one
    (the first write into new pages on CPU) cost the log-softmax 3-6x its time. Loss and gradients are
    those of ``F.cross_entropy`` on the model's own logits."""
    from megand.core.checkpointing.offline import single_process_topology
    from megand.core.tensor_parallel.random import TensorParallelRNG
    from megand.core.transformer import TransformerConfig
    from megand.models.gpt import GPTModel

    topo = single_process_topology()
    for tie in (False, True):
        cfg = TransformerConfig(arch="llama", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                seq_length=16, vocab_size=128, norm="rmsnorm", activation="swiglu",
                                position_embedding="rope", tie_embeddings=tie)
        torch.manual_seed(1)
        model = GPTModel(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        ids = torch.randint(0, 128, (2, 16))
        labels = torch.randint(0, 128, (2, 16))
        counter = _LogitsSized(2 * 16 * 128)
        with counter:
            loss = model(ids, labels=labels)
        assert len(counter.made) == 1, counter.made  # the output layer's product; no log-softmax of its own
        loss.mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.eval()  # the same model's logits (no dropout either way), the loss by torch
        logits = model(ids)
        expected = F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="none").view(2, 16)
        expected.mean().backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=5e-6, atol=1e-7)
