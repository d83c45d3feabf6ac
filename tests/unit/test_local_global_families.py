"""The analytic models of Gemma 3, OLMo 3 and SmolLM3 (sandwich and post norms, GeGLU, q/k norms over the whole
projections, NoPE layers): parameter counts and the estimator's parameter bytes equal the transformers model's,
FLOPs equal ``FlopCounterMode`` on it; what megand cannot express is refused in one line naming the key."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops
from megand.models.hf import build_hf_model
from megand.tools import convert_checkpoint
from megand.tools.estimate_memory import Layout, estimate_memory

LLAMA = dict(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, norm="rmsnorm", activation="swiglu", position_embedding="rope",
             tie_embeddings=False)
# windows as long as the sequence: transformers' eager attention computes every score, as megand counts them then
GEMMA3 = dict(LLAMA, activation="geglu", norm_placement="sandwich", norm_unit_offset=True, embedding_scale=True,
              qk_norm=True, head_dim=24, query_pre_attn_scalar=16, sliding_window=[32, 32, 32, None],
              rope_local_theta=10000.0, rope_theta=1e6, tie_embeddings=True)
OLMO3 = dict(LLAMA, norm_placement="post", qk_norm=True, qk_norm_scope="projection", sliding_window=[32, 32, 32, None])
SMOLLM3 = dict(LLAMA, no_rope=[False, False, False, True])
MODELS = {"gemma3": GEMMA3, "olmo3": OLMO3, "smollm3": SMOLLM3}


@pytest.mark.parametrize("name", MODELS)
def test_param_counts_and_state_bytes_match_transformers(name):
    cfg = MODELS[name]
    model = build_hf_model(cfg, attn_implementation="eager")
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    assert estimate_memory(cfg, Layout(precision="fp32")).stages[0].param_bytes == 4 * flops.param_counts(cfg).total


@pytest.mark.parametrize("name", MODELS)
def test_flops_match_flop_counter(name):
    cfg = MODELS[name]
    model = build_hf_model(cfg, attn_implementation="eager")
    ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"] == counter.get_total_flops()


def test_windows_shorter_than_the_sequence_count_their_band():
    """Gemma 3's local layers (window 8 of 32) count the band they see; the global layer the whole sequence."""
    q, s = 4 * 24, 32
    fwd = flops.forward_flops_per_token(dict(GEMMA3, sliding_window=[8, 8, 8, None]))
    assert fwd.attention == 3 * 4 * 8 * q + 4 * s * q


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                        ("use_bidirectional_attention", True)])
def test_gemma_keys_megand_cannot_follow_are_refused_in_one_line(key, value, tmp_path, capsys):
    from megand.models.hf_families import FAMILIES

    FAMILIES["gemma3_text"].hf_config(dict(GEMMA3)).save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **{key: value})))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and key in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, needle", [
    (dict(LLAMA, norm_placement="middle"), "model.norm_placement='middle'"),
    (dict(LLAMA, qk_norm=True, qk_norm_scope="group"), "model.qk_norm_scope='group'"),
    (dict(LLAMA, no_rope=[True]), "model.no_rope=[True]"),
    (dict(LLAMA, position_embedding="learned", no_rope=[False] * 4), "model.position_embedding=learned"),
])
def test_the_schema_refuses_bad_block_variants_naming_the_values(changes, needle):
    from megand.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        TransformerConfig.from_model(changes)
