"""Multi-token prediction on one process: each depth computes DeepSeek-V3's formula (the norms of the
previous depth's hidden state and of the embedding of the token k ahead, concatenated, projected, one
transformer layer, the shared output layer, targets k+1 ahead), evaluation and generation ignore it, and the
model schema refuses a bad depth count. (The layouts are compared with the one-process run in
tests/distributed/test_mtp_parity.py.)"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.checkpointing.offline import single_process_topology
from megand.core.tensor_parallel.random import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.models.gpt import GPTModel

S, B, V = 16, 2, 64


@pytest.fixture(scope="module")
def topo():
    yield single_process_topology()
    dist.destroy_process_group()


def build(topo, arch, depths, tie):
    cfg = TransformerConfig(arch=arch, num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            seq_length=S, vocab_size=V, norm="rmsnorm" if arch == "llama" else "layernorm",
                            activation="swiglu" if arch == "llama" else "gelu",
                            position_embedding="rope" if arch == "llama" else "learned", tie_embeddings=tie,
                            mtp_layers=depths)
    torch.manual_seed(1)
    model = GPTModel(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def reference(model, ids, labels):
    """The main and each depth's per-token losses ``[b, s - k]`` written out from the modules' weights."""
    positions = torch.arange(S)
    x = model.embedding(ids, positions)
    rope = model.rope(positions)
    for layer in model.layers.values():
        x = layer(x, rope)
    out_weight = model.output_weight
    table = model.embedding.word.weight

    def ce(normed, targets):  # normed [s', b, h], targets [b, s']
        return F.cross_entropy(F.linear(normed, out_weight)[..., :V].transpose(0, 1).flatten(0, 1),
                               targets.flatten(), reduction="none").view(targets.shape)

    x = model.final_norm(x)  # each depth reads the previous one's normalised output (the output layer's input)
    losses = [ce(x, labels)]
    for k, depth in enumerate(model.mtp.depths, start=1):  # x: the previous depth's S - k + 1 positions
        embedded = F.embedding(ids[:, k:], table).transpose(0, 1)  # the tokens k ahead: ids[t + k]
        x = depth.layer(F.linear(torch.cat([depth.enorm(embedded), depth.hnorm(x[: S - k])], -1), depth.proj.weight),
                        model.rope(positions[: S - k]))
        x = depth.final_norm(x)
        losses.append(ce(x, labels[:, k:]))  # targets k + 1 ahead: labels[t + k]
    return losses


@pytest.mark.parametrize("arch, depths, tie", [("llama", 1, False), ("llama", 2, False), ("gpt", 2, True)])
def test_depths_compute_deepseek_v3_formula(topo, arch, depths, tie):
    model = build(topo, arch, depths, tie)
    torch.manual_seed(2)
    tokens = torch.randint(0, V, (B, S + 1))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    model.train()
    loss, mtp = model(ids, labels=labels)
    expected = reference(model, ids, labels)
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-5)
    assert mtp.shape == (depths, B, S)
    for k in range(1, depths + 1):
        # depth k's loss at label position j predicts labels[j] from position j - k; none before k
        assert torch.all(mtp[k - 1][:, :k] == 0)
        torch.testing.assert_close(mtp[k - 1][:, k:], expected[k], rtol=1e-5, atol=1e-5)
    (loss.sum() + mtp.sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # evaluation and generation never run the depths
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels=labels), loss.detach(), rtol=1e-6, atol=1e-6)
        assert model(ids).shape == (B, S, V)


def test_depth_count_is_checked():
    with pytest.raises(ValueError, match="model.mtp_layers=-1"):
        TransformerConfig(mtp_layers=-1)


def test_console_line_carries_the_mtp_loss_after_the_lm_loss():
    from megand.training.metrics import console_line

    record = dict(iter=1, consumed_samples=8, iter_time_ms=1.0, lr=1e-3, global_batch_size=8, loss=5.5,
                  loss_scale=1.0, grad_norm=1.0, tokens_per_s=1.0, tflops_per_s=1.0, skipped=0)
    assert "mtp" not in console_line(record, 10)
    assert "| lm loss 5.500E+00 | mtp loss 5.250E+00 | loss scale" in console_line({**record, "mtp_loss": 5.25}, 10)
