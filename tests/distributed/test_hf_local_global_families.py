"""Gemma 3, OLMo 3 and SmolLM3 end to end: a tiny random model written by transformers' own ``save_pretrained``
is imported; greedy generation equals transformers'; a training run that names no model key has a first-step
loss equal to transformers' loss on the same batch (1e-5 relative) on one process and at tp=2 x pp=2; exported
back, every weight equals the files transformers wrote.

- Gemma 3: sandwich norms, (1 + w) norms, GeGLU, embeddings scaled by sqrt(hidden), per-head q/k norms,
  three sliding-window (local) layers per full (global) one, each kind with its own RoPE (the global one
  linearly scaled), ``query_pre_attn_scalar`` apart from the head width, one key/value head (multi-query
  attention, at tp=2 shared by the two ranks);
- OLMo 3: norms on the branch outputs only, q/k norms over the whole projections (split over tp), three
  sliding-window layers per full one (its default pattern);
- SmolLM3: no RoPE on every fourth layer (its default ``no_rope_layers``)."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             imports_by_family)

COMMON = dict(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **dict(COMMON, tie_word_embeddings=True, num_key_value_heads=1), head_dim=24, query_pre_attn_scalar=16,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
    "olmo3": lambda: transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**COMMON, sliding_window=8)),
    "smollm3": lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**COMMON)),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(family)`` -> (transformers model, its directory, the imported megand checkpoint)."""
    return imports_by_family(tmp_path_factory, FAMILIES.get)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_and_export_equal_transformers(family, imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported(family)
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(config) is type(theirs.config)
    for key in ("rope_parameters", "sliding_window", "layer_types", "no_rope_layers", "query_pre_attn_scalar"):
        if hasattr(theirs.config, key):
            assert getattr(config, key) == getattr(theirs.config, key), key


LAYOUTS = {"one": (1, []),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
           "cp2": (2, ["parallel.cp=2"])}
CASES = [(f, l) for f in FAMILIES for l in LAYOUTS]
# the default suite: every family on one process, OLMo 3 at tp=2 x pp=2 (its q/k norms' sums over tp)
DEFAULT = [c for c in CASES if c[1] == "one" or c == ("olmo3", "tp2_pp2")]
SLOW = [c for c in CASES if c not in DEFAULT]


@pytest.mark.parametrize("family, layout", DEFAULT, ids=[f"{f}-{l}" for f, l in DEFAULT])
def test_first_step_loss_equals_transformers(family, layout, imported, tmp_path):
    theirs, _, ckpt = imported(family)
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"{family} {layout}", theirs, ckpt, nproc, overrides, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", SLOW, ids=[f"{f}-{l}" for f, l in SLOW])
def test_first_step_loss_equals_transformers_matrix(family, layout, imported, tmp_path):
    theirs, _, ckpt = imported(family)
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"{family} {layout}", theirs, ckpt, nproc, overrides, tmp_path)
