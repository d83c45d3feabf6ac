"""A rank of an MoE layout rehearses on fake tensors (whose routing counts cannot be read)."""

import json

from megand.tools.rehearse import main


def test_moe_rank_rehearses_on_fake_tensors(capsys):
    main(["+experiment=tiny_llama", "model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true",
          "model.moe_capacity_factor=1.5", "--world-size", "4", "--rank", "1", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # this rank's share: the dense parts and the experts split over tp=2 (router and norms whole)
    h, f, e, layers = 64, 64, 4, 4
    experts = e * (2 * f * h + h * f) // 2
    assert report["local_params"] > layers * (experts + e * h)
    assert report["phases"]["forward_backward"]["peak_bytes"] > report["phases"]["build"]["peak_bytes"]
