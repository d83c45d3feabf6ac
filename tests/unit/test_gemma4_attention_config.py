"""The full layers' own attention shape, keys as values and key/value sharing: what cannot be built is refused
before any work in one line naming the values (the model schema, and the run's layout: a tp that divides
neither way a layer kind's key/value heads, a sharing layer on another pipeline stage than the layer it reads),
and the layers read the keys and values core's rule names."""

import pytest

from megand.core.transformer import TransformerConfig
from megand.training.config import ConfigError, compose, validate

GEMMA4_LIKE = ["model=llama_tiny", "model.num_layers=6", "model.sliding_window=[8,8,null,8,8,null]",
               "model.global_head_dim=32", "model.num_global_query_groups=1", "model.global_k_eq_v=true",
               "model.num_kv_shared_layers=2"]


def test_the_sharing_layers_read_the_last_earlier_layer_with_their_window():
    cfg = TransformerConfig(num_layers=6, sliding_window=(8, 8, None, 8, 8, None), global_head_dim=32,
                            position_embedding="rope", num_global_query_groups=1, global_k_eq_v=True,
                            num_kv_shared_layers=3, double_wide_mlp=True)
    assert [cfg.kv_source(i) for i in range(6)] == [None, None, None, 1, 1, 2]
    assert [cfg.kv_rows(i) for i in range(6)] == [2, 2, 1, 0, 0, 0]
    assert [cfg.kv_shared(i) for i in range(6)] == [False, True, True, False, False, False]
    assert [(c.head_dim, c.query_groups) for c in map(cfg.layer_config, range(6))] == \
        [(16, 4), (16, 4), (32, 1), (16, 4), (16, 4), (32, 1)]
    assert [cfg.ffn_width(i) for i in range(6)] == [256, 256, 256, 512, 512, 512]
    assert cfg.global_rope_dim == 32 and cfg.rope_dim == 16 and cfg.layer_rope(0) == "local"


@pytest.mark.parametrize("changes, message", [
    (dict(num_kv_shared_layers=6), r"model.num_kv_shared_layers=6: expected 0 <= it < model.num_layers=6"),
    (dict(sliding_window=(8, 8, 8, 8, None, None), num_kv_shared_layers=2),
     r"model.num_kv_shared_layers=2: layer 4 \(window None\) has no earlier layer with its window"),
    (dict(num_global_query_groups=3), r"model.num_global_query_groups=3: model.num_attention_heads=4 is not"),
    (dict(global_head_dim=0), r"model.global_head_dim=0: expected a positive int"),
    (dict(mtp_layers=1), r"model.global_head_dim=32 .*: needs standard attention on every layer"),
    (dict(num_kv_shared_layers=0, double_wide_mlp=True), r"model.double_wide_mlp with model.num_kv_shared_layers=0"),
])
def test_the_schema_refuses_what_cannot_be_built(changes, message):
    model = dict(num_layers=6, sliding_window=(8, 8, None, 8, 8, None), global_head_dim=32, num_kv_shared_layers=1)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**model, **changes})


@pytest.mark.parametrize("overrides, world_size, message", [
    (["model.num_attention_heads=6", "model.num_query_groups=2", "model.head_dim=16",
      "model.num_global_query_groups=3", "parallel.tp=2"], 2,
     r"model.num_global_query_groups=3 and tp=2: one must divide the other"),
    (["parallel.tp=2", "optim.name=muon"], 2, r"optim.name=muon with model.num_global_query_groups=1 < tp=2"),
    (["parallel.pp=2"], 2, r"model.num_kv_shared_layers=2: layer 5 reads the keys and values of layer 2, on another "
                           r"\(virtual\) pipeline stage \(layers per stage \[3, 3\]\)"),
])
def test_layouts_that_cannot_run_are_refused_naming_the_values(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose([*GEMMA4_LIKE, *overrides]), world_size)


def test_a_layout_with_each_sharing_layer_beside_its_source_passes():
    validate(compose([*GEMMA4_LIKE, "parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layout=[2,4]"]), 4)
