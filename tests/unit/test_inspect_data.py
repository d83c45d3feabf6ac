"""tools/inspect_data.py: datasets, blend, epochs and a layout rank's decoded samples with boundaries."""

import numpy as np

from megand.tools.inspect_data import main

from tests.unit.data_helpers import write_indexed

EOD = 7


def test_inspector_shows_a_cp_rank_samples_with_document_boundaries(tmp_path, capsys):
    docs = [np.array([10 + i % 100, 120 + i % 100, EOD]) for i in range(400)]  # 3-token documents
    prefix = write_indexed(tmp_path / "docs", docs)
    rc = main(["+experiment=tiny_llama", "data=indexed", f"data.paths=[[0.75,{prefix}],[0.25,{prefix}]]",
               f"data.eod_id={EOD}", "data.reset_position_ids=true", "data.eod_mask_loss=true",
               f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}", "parallel.cp=2",
               "--world-size", "4", "--rank", "3", "--samples", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{prefix}: 400 documents, 1200 tokens, blend weight 0.750" in out
    assert f"{prefix}: 400 documents, 1200 tokens, blend weight 0.250" in out
    assert "epoch(s) of it" in out and "the run reads 80 samples of 33 tokens" in out
    assert "rank 3 (dp 1/2, cp 1/2, pp 0/1), iteration 1:" in out
    sample = out.split("micro-batch 0 sample 0: 16 tokens (this rank's context-parallel chunks)\n")[1].splitlines()
    assert "  ⋯  " in sample[0] and " ‖ " in sample[0]  # both cp chunks, documents separated
    positions = eval(sample[1].split("positions ")[1])
    assert len(positions) == 16 and set(positions) <= {0, 1, 2}  # restart in every 3-token document
    assert sample[2].strip().startswith("loss on ") and "of 16 tokens" in sample[2]


def test_inspector_bad_input_is_one_line(tmp_path, capsys):
    rc = main(["data=indexed", f"data.paths=[[1.0,{tmp_path / 'missing'}]]", f"run_dir={tmp_path}", "--rank", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("inspect_data: ") and len(err.strip().splitlines()) == 1


def test_iteration_counts_from_one_like_the_console(tmp_path, capsys):
    common = ["+experiment=tiny_llama", "train.iters=10", f"run_dir={tmp_path / 'run'}", "--samples", "1"]
    assert main([*common, "--iteration", "10"]) == 0  # the last iteration the console prints
    assert "iteration 10:" in capsys.readouterr().out
    for bad in ("0", "11"):
        assert main([*common, "--iteration", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"inspect_data: --iteration {bad} is outside the run's iterations 1..10 (train.iters=10; " \
                      f"counted from 1 as the console line counts)"
