"""The MoE metrics a training step logs, against plain python over the routing the step used."""

import json
import math

import torch

from megand.training.config import compose
from tests.unit.test_moe import reference_capacity_keep
from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)


def test_logged_moe_metrics_match_the_routing(one_process_world):  # noqa: F811
    from megand.core.transformer.moe import Router
    from megand.training.pretrain import Trainer

    factor = 0.75
    cfg = compose(["+experiment=tiny_llama", "model=moe_tiny", f"model.moe_capacity_factor={factor}", "train.iters=1",
                   "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
                   f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    seen = {}  # layer -> [(logits, experts, scores)] of each micro-batch
    for name, module in trainer.chunks[0].named_modules():
        if isinstance(module, Router):
            module.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(name, []).append(
                tuple(t.detach().clone() for t in out[:3])))
    trainer.run()
    with open(one_process_world / "run" / "metrics.jsonl") as f:
        (record,) = [r for r in map(json.loads, f) if "loss" in r]

    e, k = cfg.model.num_experts, cfg.model.moe_top_k
    dropped, aux, z, ratios = 0, [], [], []
    for calls in seen.values():
        load = [0] * e
        for logits, scores, experts in calls:
            tokens = experts.shape[0]
            capacity = math.ceil(factor * tokens * k / e)
            keep = reference_capacity_keep(experts.tolist(), scores.gather(1, experts).tolist(), e, capacity)
            dropped += sum(not x for row in keep for x in row)
            counts = [sum(row.count(i) for row in experts.tolist()) for i in range(e)]
            load = [a + b for a, b in zip(load, counts)]
            aux.append(e * sum(counts[i] / (k * tokens) * scores[:, i].mean().item() for i in range(e)))
            z.append(torch.logsumexp(logits, -1).square().mean().item())
        ratios.append(max(load) / (sum(load) / e))
    assert len(seen) == 4 and all(len(c) == 2 for c in seen.values())  # 4 layers x 2 micro-batches
    assert record["tokens_dropped"] == dropped > 0
    assert math.isclose(record["aux_loss"], sum(aux) / len(aux), rel_tol=1e-5)
    assert math.isclose(record["z_loss"], sum(z) / len(z), rel_tol=1e-5)
    assert math.isclose(record["expert_load_max_over_mean"], max(ratios), rel_tol=1e-6)


def test_expert_biases_are_not_decayed(one_process_world):  # noqa: F811
    """GPT-style experts have stacked biases ``[E, out]``: 2-D, but biases, so AdamW does not decay them."""
    from megand.training.pretrain import Trainer

    cfg = compose(["+experiment=tiny_gpt", "model.num_experts=4", "model.moe_shared_experts=1", "train.iters=1",
                   "train.eval_iters=0", f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    decay = {piece.name: piece.decay for piece in trainer.optimizer.pieces}
    assert decay["layers.0.mlp.experts.fc1.bias"] is False and decay["layers.0.mlp.experts.fc2.bias"] is False
    assert decay["layers.0.mlp.experts.fc1.weight"] and decay["layers.0.mlp.router.weight"]
    assert decay["layers.0.mlp.shared_experts.fc1.weight"] and not decay["layers.0.mlp.shared_experts.fc1.bias"]
