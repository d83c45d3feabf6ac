"""A rank of an expert-parallel layout rehearses on fake tensors (no routing counts to read: the
dispatcher assumes even routing) and holds 1/ep of the routed experts."""

import json

from megand.tools.rehearse import main


def _local_params(capsys, ep):
    main(["+experiment=tiny_llama", "model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true",
          f"parallel.ep={ep}", "--world-size", "8", "--rank", "3", "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["local_params"]


def test_ep2_rank_rehearses_and_holds_half_the_experts(capsys):
    h, f, e, layers, tp = 64, 64, 4, 4, 2
    experts_per_rank = layers * e * (2 * f * h + h * f) // tp  # swiglu fc1 [E, 2f, h], fc2 [E, h, f], over tp
    assert _local_params(capsys, 1) - _local_params(capsys, 2) == experts_per_rank // 2
