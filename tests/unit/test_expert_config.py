"""parallel.ep / parallel.etp: bad values fail before any work, with one line naming the values."""

import pytest

from megand.training.config import ConfigError, compose, validate


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallel.ep=2"], 2, r"parallel.ep=2 needs a Mixture-of-Experts model"),
    (["parallel.ep=3"], 4, r"parallel.ep=3 must be a positive divisor of dp\*cp = 4\*1 = 4"),
    (["parallel.tp=2", "parallel.etp=4"], 4, r"parallel.etp=4 must be 1 or parallel.tp=2"),
    (["parallel.tp=2", "parallel.ep=2", "parallel.pp=2", "parallel.order=pp-dp-cp-tp"], 8,
     r"parallel.order='pp-dp-cp-tp' with ep=2, etp=2: the expert grid"),
    (["model=moe_tiny", "model.num_experts=6", "parallel.ep=4"], 4, r"model.num_experts=6 is not divisible by parallel.ep=4"),
    (["model=moe_tiny", "model.arch=gpt", "parallel.tp=2", "parallel.ep=2"], 4,
     r"parallel.ep=2 with experts split over parallel.etp=2 needs bias-free experts"),
    (["model=moe_tiny", "parallel.ep=2", "optim.sharding=optim", "parallel.dp_shard=2"], 4,
     r"parallel.dp_shard=2 \(hybrid sharding\) with parallel.ep=2 is not supported"),
])
def test_expert_layout_errors(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides), world_size)


def test_default_expert_layout_is_valid():
    validate(compose(["parallel.tp=2", "parallel.etp=1"]), 4)
    validate(compose(["parallel.tp=2", "parallel.etp=2"]), 4)
