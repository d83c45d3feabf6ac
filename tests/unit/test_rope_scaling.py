"""RoPE frequency scaling (``model.rope_scaling``): the frequencies and the cos/sin factor of each type equal
transformers' own (its rope init functions on a config of the same shape); a bad dict is one line."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megand.core.transformer.config import TransformerConfig
from megand.core.transformer.rope import RopeScaling, inverse_frequencies

SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn_mscale": dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707),
}


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("head_dim", [16, 128])
def test_frequencies_equal_transformers(name, head_dim):
    scaling = SCALINGS[name]
    theta = 500000.0
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=256,
                                      rope_parameters={**scaling, "rope_theta": theta})
    theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    ours, our_factor = inverse_frequencies(head_dim, theta, RopeScaling.from_dict(scaling))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    assert not torch.allclose(ours, inverse_frequencies(head_dim, theta)[0])  # the scaling changed something


@pytest.mark.parametrize("scaling, message", [
    (dict(rope_type="dynamic", factor=2.0), r"rope_type='dynamic': expected one of linear, llama3, yarn"),
    (dict(rope_type="llama3", factor=8.0), r"rope_type=llama3 needs original_max_position_embeddings"),
    (dict(rope_type="linear"), r"model.rope_scaling.factor=None must be > 0"),
    (dict(rope_type="linear", factor=2.0, scale=3), r"unknown key\(s\) scale"),
])
def test_a_bad_scaling_is_one_line_naming_the_key(scaling, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(arch="llama", position_embedding="rope", rope_scaling=scaling)


def test_scaling_without_rotary_embedding_is_refused():
    with pytest.raises(ValueError, match="model.rope_scaling is set but model.position_embedding=learned"):
        TransformerConfig(rope_scaling=SCALINGS["linear"])
