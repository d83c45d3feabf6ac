"""Gemma 4's pieces one at a time: its proportional RoPE equals transformers' frequencies; the analytic model
(parameters, FLOPs) equals the transformers model's (``FlopCounterMode``); the estimator's terms for the sandwich
norms, the value norm, the soft-capped logits and values equal to the keys equal the bytes megand's layer saves;
the full layers' own head width and key/value heads, keys as values and key/value sharing across layers (with
the sharing layers' double-wide MLP) count as transformers' model does; what megand cannot express (a
per_layer_config of other keys or of several shapes per layer type, bidirectional attention, a layer scalar other
than 1) is refused in one line naming the key (per-layer input embeddings and the MoE block:
test_gemma4_ple_moe.py)."""

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.utils.flop_counter import FlopCounterMode

from megand.core.checkpointing.offline import single_process_topology
from megand.core.tensor_parallel.random import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.core.transformer.rope import RopeScaling, inverse_frequencies
from megand.models import flops
from megand.models.hf import build_hf_model
from megand.models.hf_families import FAMILIES
from megand.tools import convert_checkpoint
from megand.tools.estimate_memory import Layout, estimate_memory, layer_activation_bytes

# windows as long as the sequence: transformers' eager attention computes every score, as megand counts them then
GEMMA4 = dict(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
              num_query_groups=2, head_dim=16, seq_length=32, vocab_size=256, norm="rmsnorm", activation="geglu",
              position_embedding="rope", norm_placement="sandwich", embedding_scale=True, qk_norm=True, v_norm=True,
              query_pre_attn_scalar=1, sliding_window=[32, 32, 32, None], rope_local_theta=10000.0, rope_theta=1e6,
              rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
              final_logit_softcapping=30.0, tie_embeddings=True)
# the full layers (2 and 5) with a head width and one key/value head of their own and their keys as values; the
# last two layers read the keys and values of layers 3 and 2
GEMMA4_ATTENTION = dict(GEMMA4, num_layers=6, sliding_window=[32, 32, None, 32, 32, None], global_head_dim=32,
                        num_global_query_groups=1, global_k_eq_v=True, num_kv_shared_layers=2)
ATTENTION_SHAPES = {"full_layers_shape_keys_as_values_sharing": GEMMA4_ATTENTION,
                    "sharing_three_layers_double_wide": dict(GEMMA4_ATTENTION, global_k_eq_v=False,
                                                             num_global_query_groups=None, num_kv_shared_layers=3,
                                                             double_wide_mlp=True),
                    "full_layers_narrower_more_heads": dict(GEMMA4, global_head_dim=8, num_global_query_groups=4)}


@pytest.mark.parametrize("share, factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0), (0.0, 1.0)])
def test_proportional_rope_equals_transformers(share, factor):
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    full = {"rope_type": "proportional", "partial_rotary_factor": share, "rope_theta": 1e6, "factor": factor}
    config = Gemma4TextConfig(head_dim=48, global_head_dim=48, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"full_attention": full,
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    ours, scale = inverse_frequencies(48, 1e6, RopeScaling.from_dict(
        {"rope_type": "proportional", "partial_rotary_factor": share, "factor": factor}))
    assert scale == 1.0 and torch.equal(ours, theirs)


MODELS = [GEMMA4, *ATTENTION_SHAPES.values()]
IDS = ["gemma4", *ATTENTION_SHAPES]


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_param_counts_and_state_bytes_match_transformers(model):
    hf = build_hf_model(model, attn_implementation="eager")
    assert flops.param_counts(model).total == sum(p.numel() for p in hf.parameters())
    assert estimate_memory(model, Layout(precision="fp32")).stages[0].param_bytes == 4 * flops.param_counts(model).total


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_flops_match_flop_counter(model):
    hf = build_hf_model(model, attn_implementation="eager")
    ids = torch.randint(0, model["vocab_size"], (2, model["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        hf(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(model, global_batch_size=2)["model_flops"] == counter.get_total_flops()


def test_recomputed_layers_count_their_own_attention():
    """Recomputing exactly the layers of a shape of their own adds their own forward (the selective form: their
    core alone)."""
    full = flops.hardware_flops_per_token(GEMMA4_ATTENTION, "full")
    by_layer = flops.hardware_flops_per_token(GEMMA4_ATTENTION, "full", recomputed_layers=range(6))
    assert full == by_layer


@pytest.fixture(scope="module")
def topo():
    yield single_process_topology()
    dist.destroy_process_group()


def saved_bytes(model: dict, topo, layer_id: int = 0) -> int:
    """Bytes of the distinct storages one megand layer saves for backward (fp32, one sample)."""
    from megand.core.transformer.layer import TransformerLayer

    cfg = TransformerConfig.from_model(model)
    layer = TransformerLayer(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")), torch.device("cpu"),
                             layer_id=layer_id)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(cfg.seq_length, 1, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, shared={})
    return sum(storages.values())


def test_values_equal_to_the_keys_store_no_value_rows(topo):
    """A full layer whose values are its keys' projection (layer 2) stores e·kv less per token (its own
    kv: one head of 32): what the estimator counts and what megand's layer saves."""
    layout = Layout(precision="fp32")
    apart = dict(GEMMA4_ATTENTION, global_k_eq_v=False)
    term = layer_activation_bytes(apart, layout, layer=2) - layer_activation_bytes(GEMMA4_ATTENTION, layout, layer=2)
    assert term == 32 * 4 * 32
    weight = 64 * 32 * 4  # the QKV weight's value rows, which its product saves too: parameters, not activations
    measured = saved_bytes(apart, topo, 2) - saved_bytes(GEMMA4_ATTENTION, topo, 2) - weight
    assert measured == term, (measured, term)


def test_sandwich_and_value_norm_activation_terms_equal_what_the_layer_saves(topo):
    """The value norm's output (e·kv per token) and the two branch-output norms' inputs (2·e·h) are what the
    estimator adds; measured on megand's layer within the norms' per-token statistics. On the CPU an RMSNorm with
    a weight also keeps its normalised output for the weight's gradient (e·h more; a fused kernel keeps only
    the input, as the estimator counts every norm), so the sandwich's norms measure twice their term."""
    layout = Layout(precision="fp32")
    no_v_norm, pre = dict(GEMMA4, v_norm=False), dict(GEMMA4, v_norm=False, norm_placement="pre")
    v_term = layer_activation_bytes(GEMMA4, layout) - layer_activation_bytes(no_v_norm, layout)
    sandwich_term = layer_activation_bytes(no_v_norm, layout) - layer_activation_bytes(pre, layout)
    assert (v_term, sandwich_term) == (32 * 4 * 2 * 16, 32 * 4 * 2 * 64)
    v_measured = saved_bytes(GEMMA4, topo) - saved_bytes(no_v_norm, topo)
    sandwich_measured = saved_bytes(no_v_norm, topo) - saved_bytes(pre, topo)
    assert abs(v_measured - v_term) <= 0.1 * v_term, (v_measured, v_term)
    assert abs(sandwich_measured - 2 * sandwich_term) <= 0.05 * sandwich_term, (sandwich_measured, sandwich_term)


def test_soft_capped_logits_keep_their_tanh_output():
    layout = Layout.of(precision="bf16", tp=2)
    uncapped = dict(GEMMA4, final_logit_softcapping=None)
    extra = estimate_memory(GEMMA4, layout).stages[0].extra_activation_bytes
    assert extra - estimate_memory(uncapped, layout).stages[0].extra_activation_bytes == 32 * 2 * 256 / 2


def write_hf(tmp_path, shape=None, **changes):
    """The files of a tiny Gemma 4 (its config built with ``shape``: keys its class turns into others) and its
    config.json with ``changes``; its directory."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = FAMILIES["gemma4_text"].hf_config(dict(GEMMA4))
    if shape:
        keys = {k: v for k, v in config.to_dict().items() if k not in ("per_layer_config", "model_type", *shape)}
        config = Gemma4TextConfig(**keys, **shape)
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
    return tmp_path


def refusal(hf_dir, tmp_path, capsys) -> str:
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(hf_dir), "--save", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and not (tmp_path / "out").exists(), err
    return err[0]


@pytest.mark.parametrize("key, value", [("use_bidirectional_attention", "all")])
def test_what_megand_cannot_express_is_refused_in_one_line(key, value, tmp_path, capsys):
    assert key in refusal(write_hf(tmp_path / "hf", **{key: value}), tmp_path, capsys)


@pytest.mark.parametrize("per_layer, needle", [({"3": {"head_dim": 16, "sliding_window": 4}}, "['sliding_window']"),
                                               ({"0": {"head_dim": 32}}, "sliding_attention")])
def test_per_layer_config_megand_cannot_follow_is_refused_in_one_line(per_layer, needle, tmp_path, capsys):
    """transformers writes the full layers' own head width and key/value heads into ``per_layer_config``; any
    other key, or layers of one type with several shapes, is refused."""
    line = refusal(write_hf(tmp_path / "hf", per_layer_config=per_layer), tmp_path, capsys)
    assert "per_layer_config" in line and needle in line


def test_a_layer_scalar_other_than_one_is_refused_by_name(tmp_path, capsys):
    hf_dir = write_hf(tmp_path / "hf")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["model.layers.2.layer_scalar"] = torch.tensor([0.5])
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.2.layer_scalar holds [0.5]" in refusal(hf_dir, tmp_path, capsys)


@pytest.mark.parametrize("changes, needle", [
    (dict(final_logit_softcapping=-1.0), "model.final_logit_softcapping=-1.0"),
    (dict(final_logit_softcapping=30.0, embedding_scale=False, mtp_layers=1), "model.final_logit_softcapping=30.0 (model.mtp_layers=1)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "model.rope_scaling.partial_rotary_factor=0.5"),
])
def test_the_schema_refuses_bad_values_naming_them(changes, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig.from_model(dict(GEMMA4, **changes))
