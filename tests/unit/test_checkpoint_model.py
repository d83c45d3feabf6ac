"""Training from a checkpoint needs no model keys: ``checkpoint.load=DIR`` alone takes the model the
checkpoint holds; keys that contradict it are one line naming them; training keys (``seq_length`` within
the model's positions, dropout) may be set."""

import pytest

from megand.models import full
from megand.training.checkpoint_model import adopt_checkpoint_model
from megand.training.config import ConfigError, compose, transformer_config, validate
from tests.harness import run_pretrain

SAVED = dict(arch="llama", num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             head_dim=16, seq_length=32, vocab_size=200, norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
             position_embedding="rope", rope_theta=500000.0, qk_norm=True, tie_embeddings=False,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    full.save_random_model(path, SAVED)
    return path


def adopt(overrides, model_choice="gpt_tiny"):
    cfg = compose(overrides)
    taken = adopt_checkpoint_model(cfg, list(overrides), model_choice)
    return cfg, taken


def test_no_model_key_takes_the_checkpoints_model(ckpt):
    cfg, taken = adopt([f"checkpoint.load={ckpt}"])
    validate(cfg, 1)
    assert {k: cfg.model[k] for k in SAVED if k != "rope_scaling"} == {k: v for k, v in SAVED.items() if k != "rope_scaling"}
    assert transformer_config(cfg).rope_scaling.rope_type == "llama3" and "num_layers" in taken


def test_training_keys_may_be_set_within_the_models_positions(ckpt):
    cfg, _ = adopt([f"checkpoint.load={ckpt}", "model.seq_length=16", "model.hidden_dropout=0.1"])
    assert (cfg.model.seq_length, cfg.model.hidden_dropout, cfg.model.hidden_size) == (16, 0.1, 48)
    with pytest.raises(ConfigError, match=r"model.seq_length: checkpoint 32, this run 64 \(beyond the model's 32 positions\)"):
        adopt([f"checkpoint.load={ckpt}", "model.seq_length=64"])


def test_contradicting_keys_are_one_line_naming_each(ckpt):
    with pytest.raises(ConfigError) as e:
        adopt([f"checkpoint.load={ckpt}", "model.hidden_size=64", "model.qk_norm=false"])
    message = str(e.value)
    assert "\n" not in message and "model.hidden_size: checkpoint 48, this run 64" in message
    assert "model.qk_norm: checkpoint True, this run False" in message
    # a preset picked by the run (model=NAME or an experiment) is compared whole
    with pytest.raises(ConfigError, match=r"model.num_layers: checkpoint 2, this run 4.*model.qk_norm"):
        adopt([f"checkpoint.load={ckpt}", "model=llama_tiny"], "llama_tiny")


def test_a_load_path_without_a_checkpoint_changes_nothing(tmp_path):
    cfg, taken = adopt([f"checkpoint.load={tmp_path}/none", f"checkpoint.save={tmp_path}/none"])
    assert taken == [] and cfg.model.arch == "gpt"


def test_the_entry_script_refuses_a_contradiction_in_one_line(ckpt, tmp_path):
    proc = run_pretrain(str(tmp_path / "run"), [f"checkpoint.load={ckpt}", "model.num_layers=3"], check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megand:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "model.num_layers: checkpoint 2, this run 3" in lines[0]


def test_a_derived_head_width_equals_the_same_width_set(tmp_path):
    path = str(tmp_path / "derived")
    full.save_random_model(path, dict(SAVED, hidden_size=64, head_dim=None))  # hidden/heads = 16
    cfg, _ = adopt([f"checkpoint.load={path}", "model.head_dim=16", "model.num_query_groups=2"])
    assert cfg.model.head_dim == 16
    with pytest.raises(ConfigError, match=r"model.head_dim: checkpoint None, this run 32"):
        adopt([f"checkpoint.load={path}", "model.head_dim=32"])


LLAMA3_1 = dict(intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
                hidden_size=4096, max_position_embeddings=131072, rms_norm_eps=1e-5, vocab_size=128256,
                tie_word_embeddings=False, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192})
PUBLISHED = {  # the published configs' shape keys (no weights)
    "llama3_1_8b": ("LlamaConfig", LLAMA3_1),
    "llama3_1_70b": ("LlamaConfig", dict(LLAMA3_1, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                         num_hidden_layers=80)),
    "qwen3_8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                     num_hidden_layers=36, num_key_value_heads=8, head_dim=128,
                                     max_position_embeddings=40960, rms_norm_eps=1e-6, vocab_size=151936,
                                     tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_30b_a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                             num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                             max_position_embeddings=40960, rms_norm_eps=1e-6, vocab_size=151936,
                                             tie_word_embeddings=False, router_aux_loss_coef=0.001,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_equal_the_model_an_import_of_the_published_config_gives(preset):
    """``model=PRESET checkpoint.load=<imported checkpoint>`` passes the model check: every architectural key
    of the preset equals what the importer derives from the published config."""
    import transformers

    from megand.core.transformer.config import MODEL_FIELDS
    from megand.models import hf_families
    from megand.training.checkpoint_model import contradictions

    cls, values = PUBLISHED[preset]
    config = getattr(transformers, cls)(**values)
    imported = hf_families.family_for_hf(config).model_config(config)
    run = compose([f"model={preset}"])
    validate(run, 1)
    from omegaconf import OmegaConf

    assert contradictions(imported, OmegaConf.to_container(run.model, resolve=True), MODEL_FIELDS) == []
