"""Invalid configurations fail before any work, with a message naming the values."""

import pytest
from hydra.errors import ConfigCompositionException

from megand.training.config import ConfigError, compose, validate
from tests.harness import run_pretrain


HYBRID = ["model=llama_tiny", "model.layer_types=[linear_attention,linear_attention,linear_attention,attention]"]


def check(overrides, world_size=1):
    validate(compose(overrides), world_size)


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallel.tp=4"], 6, r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"),
    (["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"], 4, r"world size 4 is not divisible by tp\*pp\*cp"),
    (["parallel.tp=8"], 8, r"model.num_attention_heads=4 is not divisible by parallel.tp=8"),
    (["model=llama_tiny", "model.num_attention_heads=6", "model.num_query_groups=3", "model.head_dim=16",
      "parallel.tp=2"], 2, r"model.num_query_groups=3 and parallel.tp=2: one must divide the other"),
    (["model=llama_tiny", "model.num_query_groups=1", "parallel.tp=2", "optim.name=muon"], 2,
     r"optim.name=muon with model.num_query_groups=1 < parallel.tp=2: .*each whole matrix of the fused QKV"),
    (["model.num_query_groups=3"], 1, r"model.num_attention_heads=4 is not divisible by model.num_query_groups=3"),
    (["train.global_batch_size=6", "train.micro_batch_size=2"], 2,
     r"train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x dp=2 = 4"),
    (["model.seq_length=30", "parallel.tp=4", "parallel.sequence_parallel=true"], 4,
     r"model.seq_length=30 is not divisible by 4"),
    (["model.seq_length=36", "parallel.cp=4"], 4, r"model.seq_length=36 is not divisible by 8"),
    (["model.arch=bert"], 1, r"model.arch='bert': expected one of gpt, llama"),
    (["train.precision=fp8"], 1, r"train.precision='fp8'"),
    (["parallel.pp=3"], 3, r"model.num_layers=4 cannot be split evenly over parallel.pp=3"),
    (["parallel.pp=2", "parallel.pipeline_layout=[3,2]"], 2, r"parallel.pipeline_layout=\[3, 2\] must have"),
    (["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=6", "train.micro_batch_size=2"], 2,
     r"micro-batches \(3 .*multiple of parallel.pp=2"),
    (["parallel.order=tp-dp-pp"], 1, r"parallel.order='tp-dp-pp'"),
    (["model=llama_tiny", "model.seq_length=64", "parallel.cp=8", "parallel.cp_comm=a2a"], 8,
     r"cp_comm=a2a .*model.num_attention_heads=4 / parallel.tp=1\) must be divisible by parallel.cp=8 "
     r"\(model.num_query_groups=2\)"),
    (["optim.distributed=true"], 1, r"optim.distributed=True was replaced by optim.sharding: use optim.sharding=optim"),
    (["optim.distributed=false"], 1, r"optim.distributed=False was replaced by optim.sharding: use optim.sharding=none"),
    (["optim.sharding=zero3"], 1, r"optim.sharding='zero3': expected one of none, optim, optim_grads, optim_grads_params"),
    (["optim.name=sgd"], 1, r"optim.name='sgd': expected one of adamw, muon, lion"),
    (["optim.sharding=optim_grads_params", "parallel.dp_shard=3"], 4, r"parallel.dp_shard=3 must be a positive divisor of dp\*cp = 4\*1 = 4"),
    (["parallel.dp_shard=2"], 4, r"parallel.dp_shard=2 shards nothing with optim.sharding=none"),
    (["model.make_vocab_size_divisible_by=0"], 1, r"model.make_vocab_size_divisible_by=0 must be positive"),
    (["model.norm_eps=0"], 1, r"model.norm_eps=0.0 must be > 0"),
    ([*HYBRID, "model.seq_length=16", "parallel.cp=4"], 4,
     r"model.seq_length=16 gives 2 tokens per context-parallel chunk .*model.linear_conv_kernel - 1 = 3"),
    ([*HYBRID, "model.linear_num_key_heads=3", "model.linear_num_value_heads=6", "parallel.tp=2"], 2,
     r"model.linear_num_key_heads=3 is not divisible by parallel.tp=2"),
    ([*HYBRID[:1], "model.layer_types=[linear_attention,attention]"], 1, r"model.layer_types=.*model.num_layers=4"),
])
def test_invalid_values_are_named(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check(overrides, world_size)


def test_valid_layouts_pass():
    check(["parallel.tp=2", "parallel.sequence_parallel=true"], 4)
    check(["model=llama_tiny", "parallel.tp=2", "parallel.cp=2"], 8)
    check(["optim.sharding=optim_grads_params", "parallel.cp=2", "parallel.dp_shard=2"], 8)
    check(["optim.name=lion"], 2)


def test_unknown_keys_and_wrong_types_are_rejected_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="model.hidden"):
        compose(["model.hidden=64"])
    with pytest.raises(ConfigError, match="model.hidden"):
        check(["+model.hidden=64"])
    with pytest.raises(ConfigCompositionException, match="parallel.tp=two"):
        compose(["parallel.tp=two"])


def test_launch_with_an_invalid_layout_fails_before_training(tmp_path):
    proc = run_pretrain(tmp_path, ["+experiment=tiny_gpt", "parallel.tp=2"], nproc=1, check=False)
    assert proc.returncode != 0
    assert "world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, message", [
    ("train.iters=-3", r"train.iters=-3 must be >= 1"),
    ("train.iters=0", r"train.iters=0 must be >= 1"),
    ("train.global_batch_size=-8", r"train.global_batch_size=-8 must be >= 1"),
    ("train.micro_batch_size=0", r"train.micro_batch_size=0 must be >= 1"),
    ("train.log_interval=0", r"train.log_interval=0 must be >= 1"),
    ("train.eval_iters=-1", r"train.eval_iters=-1 must be >= 0"),
    ("checkpoint.interval=-5", r"checkpoint.interval=-5 must be >= 0"),
    ("data.split='0,0,0'", r"data.split='0,0,0': parts must be non-negative with a positive sum"),
    ("data.split='a,b'", r"data.split='a,b': expected comma-separated numbers"),
])
def test_counts_and_split_are_checked_by_validate(override, message):
    with pytest.raises(ConfigError, match=message):
        check([override])


@pytest.mark.parametrize("override, value", [("train.iters=-3", "train.iters=-3"),
                                             ("data.split='a,b'", "data.split='a,b'")])
def test_launch_with_a_bad_count_is_one_line_exit_2(tmp_path, override, value):
    proc = run_pretrain(tmp_path, ["+experiment=tiny_gpt", override], nproc=1, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and value in proc.stderr, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
