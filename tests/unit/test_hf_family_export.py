"""Export picks the one Hugging Face family that expresses every architecture key of the model, and refuses
(exit 2, one line, nothing written) a model no family expresses or a checkpoint tensor its rules do not
cover: a key or a tensor is never silently dropped."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from megand.models import full
from megand.tools import convert_checkpoint
from megand.training.config import compose


def tiny_gpt(**changes) -> dict:
    """``+experiment=tiny_gpt`` with ``model.<key>=<value>`` overrides: the model section a run saves."""
    cfg = compose(["+experiment=tiny_gpt", *(f"model.{k}={v}" for k, v in changes.items())])
    return OmegaConf.to_container(cfg.model, resolve=True)


def run(capsys, *argv):
    """(exit code, stderr lines) of the converter."""
    capsys.readouterr()
    rc = convert_checkpoint.main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("key, value, shown", [("qk_norm", "true", "model.qk_norm=True"),
                                               ("sliding_window", "8", "model.sliding_window=8")])
def test_a_gpt_with_a_key_gpt2_does_not_express_is_refused(key, value, shown, tmp_path, capsys):
    """GPT-2 has no q/k norms and no window: exporting these as gpt2 wrote another function (with q/k norms,
    52 of the checkpoint's 60 tensors)."""
    full.save_random_model(str(tmp_path / "ckpt"), tiny_gpt(**{key: value}))
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert rc == 2 and len(err) == 1 and shown in err[0] and "gpt2" in err[0], err
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_tensor_the_rules_do_not_cover_is_refused(tmp_path, capsys, monkeypatch):
    """A checkpoint holding q/k norms whose config says none (what a family whose rules forget a tensor does):
    the tensors are named, not dropped."""
    full.save_random_model(str(tmp_path / "ckpt"), tiny_gpt(qk_norm="true"))
    real = full.read_config
    monkeypatch.setattr(full, "read_config",
                        lambda path: OmegaConf.create({"model": dict(real(path).model, qk_norm=False)}))
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert rc == 2 and len(err) == 1 and "gpt2" in err[0], err
    assert "tensor layers.0.attention.k_norm.weight (8 in all) is not covered" in err[0]
    assert not (tmp_path / "hf").exists()


def test_the_plain_tiny_gpt_still_exports_as_gpt2(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), tiny_gpt(), torch.float32)
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))[0] == 0
    assert os.path.isfile(tmp_path / "hf" / "config.json")
    assert '"model_type": "gpt2"' in (tmp_path / "hf" / "config.json").read_text()
