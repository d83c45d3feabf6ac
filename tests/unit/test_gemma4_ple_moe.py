"""Gemma 4's per-layer input embeddings and MoE block one piece at a time: the analytic model (parameters, FLOPs)
equals the transformers model's (``FlopCounterMode``); the memory estimator holds each stage's own share of the
per-layer tables and the first stage alone the projection; a model holding them builds each layer's table on its
own pipeline stage only, split by vocab rows over tp; bad values are refused in one line naming them."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megand.core.transformer import TransformerConfig
from megand.models import flops
from megand.models.hf import build_hf_model
from tests.unit.test_gemma4 import GEMMA4  # the sandwich-norm, soft-capped Gemma 4 the pieces are added to

PLE = dict(GEMMA4, per_layer_input_size=8)
MOE = dict(GEMMA4, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_beside_mlp=True)
BOTH = dict(PLE, **{k: v for k, v in MOE.items() if k not in GEMMA4})
# with Gemma 4's attention shapes too: the full layers' own head width and key/value head, keys as values, the last
# two layers reading earlier keys/values with their MLP (beside the experts) twice as wide
ALL = dict(BOTH, num_layers=6, sliding_window=[32, 32, None] * 2, global_head_dim=32, num_global_query_groups=1,
           global_k_eq_v=True, num_kv_shared_layers=2, double_wide_mlp=True)


@pytest.mark.parametrize("cfg", [PLE, MOE, BOTH, ALL], ids=["ple", "moe", "ple_moe", "with_attention_shapes"])
def test_params_and_flops_match_transformers(cfg):
    model = build_hf_model(cfg, attn_implementation="eager", experts_implementation="eager")
    counts = flops.param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    if cfg.get("per_layer_input_size"):
        assert counts.per_layer_tables == model.model.embed_tokens_per_layer.weight.numel()
        assert counts.per_layer_projection == cfg["num_layers"] * 8 * 64 + 8
    ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"] == counter.get_total_flops()


@pytest.mark.parametrize("changes, needle", [
    (dict(per_layer_input_size=8, activation="swiglu"), "model.per_layer_input_size=8"),
    (dict(per_layer_input_size=8, per_layer_input_vocab_size=100), "model.per_layer_input_vocab_size=100"),
    (dict(num_experts=4, moe_beside_mlp=True, moe_router="sigmoid"), "moe_router=softmax (got sigmoid)"),
    (dict(moe_beside_mlp=True), "model.moe_beside_mlp (Gemma 4's MoE block) needs model.num_experts (got None)"),
])
def test_the_schema_refuses_bad_values_naming_them(changes, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig.from_model(dict(GEMMA4, **changes))


@pytest.fixture(scope="module")
def topo():
    import torch.distributed as dist

    from megand.core.checkpointing.offline import single_process_topology

    yield single_process_topology()
    dist.destroy_process_group()


def stage_model(cfg, topo, layer_ids, pre_process, post_process):
    from megand.core.tensor_parallel.random import TensorParallelRNG
    from megand.models.gpt import GPTModel

    return GPTModel(TransformerConfig.from_model(cfg), topo, TensorParallelRNG(1, 0, torch.device("cpu")), layer_ids,
                    pre_process, post_process, device=torch.device("meta"))


def test_each_stage_holds_its_layers_tables_and_the_first_the_projection(topo):
    """Two pipeline stages: the first holds the projection and layers 0-1's tables, the second layers 2-3's (and
    the tied output layer's copy): what the estimator counts for each, and the whole model's parameters."""
    from megand.tools.estimate_memory import Layout, estimate_memory, stage_params

    layout = Layout.of(precision="fp32", pp=2)
    first, last = stage_model(BOTH, topo, [0, 1], True, False), stage_model(BOTH, topo, [2, 3], False, True)
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    assert "per_layer_inputs.weight" in names and not any(n.startswith("per_layer_inputs") for n, _ in last.named_parameters())
    assert {n for n in names if n.endswith("per_layer_input.embedding.weight")} == {
        f"layers.{i}.per_layer_input.embedding.weight" for i in range(4)}
    for stage, model in enumerate((first, last)):
        assert stage_params(BOTH, layout, stage) == sum(p.numel() for p in model.parameters()), stage
    one = estimate_memory(BOTH, Layout(precision="fp32")).stages[0]
    assert one.param_bytes == 4 * flops.param_counts(BOTH).total


def saved_bytes(model: dict, topo) -> int:
    """Bytes of the distinct storages one megand layer (with its per-layer input when the model has them) saves
    for backward, its own weights left out (fp32, one sample)."""
    from megand.core.tensor_parallel.random import TensorParallelRNG
    from megand.core.transformer.layer import TransformerLayer

    cfg = TransformerConfig.from_model(model)
    layer = TransformerLayer(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")), torch.device("cpu"))
    storages, weights = {}, {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(cfg.seq_length, 1, cfg.hidden_size, requires_grad=True)
    per_layer = None
    if cfg.per_layer_input_size:
        ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
        per_layer = (ids, torch.randn(cfg.seq_length, 1, cfg.per_layer_input_size, requires_grad=True))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, per_layer=per_layer)
    return sum(storages.values())


def test_per_layer_input_activation_term_equals_what_the_layer_saves(topo):
    """The gated branch's term (2·e·h + 4·e·p per token) against megand's layer: on the CPU the branch's RMSNorm
    also keeps its normalised output for its weight's gradient (e·h more; the estimator counts a norm's input),
    and the lookup its ids (8 bytes per token)."""
    from megand.tools.estimate_memory import Layout, layer_activation_bytes

    layout = Layout(precision="fp32")
    term = layer_activation_bytes(PLE, layout) - layer_activation_bytes(GEMMA4, layout)
    assert term == 32 * 4 * (2 * 64 + 4 * 8)
    measured = saved_bytes(PLE, topo) - saved_bytes(GEMMA4, topo)
    cpu_norm_output, ids = 32 * 4 * 64, 32 * 8
    assert abs(measured - (term + cpu_norm_output + ids)) <= 0.05 * term, (measured, term)


def test_a_per_layer_table_shorter_than_the_vocabulary_is_refused_in_one_line(tmp_path, capsys):
    import json

    from megand.models.hf_families import FAMILIES
    from megand.tools import convert_checkpoint

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    build_hf_model(PLE).save_pretrained(str(hf_dir))
    path = hf_dir / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), vocab_size_per_layer_input=200)))
    assert FAMILIES["gemma4_text"].model_type == json.loads(path.read_text())["model_type"]
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(hf_dir), "--save", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "vocab_size_per_layer_input=200 is below vocab_size=256" in err[0], err
