"""The model of a run that loads a checkpoint: taken from the checkpoint unless the run names one.

``pretrain_gpt.py checkpoint.load=DIR`` with no ``model=`` and no ``model.*`` key trains the model the
checkpoint holds (an imported Hugging Face model needs no key typed by hand). Keys the run does give are
checked against it: an architectural key that contradicts the checkpoint is one line naming every such key;
a training key (dropout, ``seq_length`` within the model's positions, ...) may differ.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from megand.core.transformer.config import ARCHITECTURE_FIELDS, MODEL_FIELDS, comparable
from megand.training.config import CONF_DIR, ConfigError

DEFAULT_MODEL = "gpt_tiny"  # conf/config.yaml's model group default


def saved_model(path: str) -> dict | None:
    """The ``model`` section stored with the checkpoint ``path`` designates (checksummed first: a damaged
    file is a CheckpointError naming it); None when ``path`` holds no checkpoint yet (a run resuming from
    its own save directory starts from scratch)."""
    import json

    from megand.core.checkpointing import CheckpointError
    from megand.core.checkpointing import files

    try:
        iter_dir = files.resolve(path)
    except CheckpointError:
        return None  # the load itself reports what is wrong with the path, or starts from scratch
    manifest = os.path.join(iter_dir, files.MANIFEST)
    common = os.path.join(iter_dir, files.COMMON)
    if os.path.isfile(manifest) and os.path.isfile(common):
        with open(manifest) as f:
            crc = json.load(f)["crc32"].get(files.COMMON)
        if crc is not None and files.file_crc(common) != crc:
            raise CheckpointError(f"{common}: corrupted: checksum {files.file_crc(common):08x}, expected "
                                  f"{crc:08x} (recorded at save time)")
    model = files.read_common(iter_dir).get("model")
    return dict(model) if model else None


def given_model_keys(cfg, overrides: list[str], model_choice: str | None) -> set[str] | None:
    """The model keys the run itself sets: None when it picks a model preset (``model=NAME``, or an
    experiment overriding the model group): then every key is given; else the ``model.KEY=`` overrides and
    any key that differs from the default preset (set by an experiment's body)."""
    if model_choice not in (None, DEFAULT_MODEL) or any(o.split("=", 1)[0].lstrip("+~") == "model" for o in overrides):
        return None
    given = {o.split("=", 1)[0].lstrip("+~").split(".", 2)[1] for o in overrides
             if o.lstrip("+~").startswith("model.")}
    default = OmegaConf.load(os.path.join(CONF_DIR, "model", f"{DEFAULT_MODEL}.yaml"))
    composed = OmegaConf.to_container(cfg.model, resolve=True)
    from megand.training.config import ModelConfig

    base = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ModelConfig), default), resolve=True)
    return given | {k for k, v in composed.items() if base.get(k) != v}


def contradictions(saved: dict, model: dict, keys) -> list[str]:
    """``model.KEY: checkpoint A, this run B`` for each architectural key in ``keys`` that differs."""
    out = []
    same_saved, same_model = comparable(saved), comparable(model)  # head_dim null == hidden/heads, ...
    for k in sorted(keys):
        if k in ARCHITECTURE_FIELDS and k in saved and same_saved[k] != same_model.get(k):
            out.append(f"model.{k}: checkpoint {saved[k]!r}, this run {model.get(k)!r}")
    if "seq_length" in keys and "seq_length" in saved and model["seq_length"] != saved["seq_length"]:
        learned = saved.get("position_embedding") == "learned"
        if learned or model["seq_length"] > saved["seq_length"]:
            why = (f"its learned position table has exactly {saved['seq_length']} rows" if learned
                   else f"beyond the model's {saved['seq_length']} positions")
            out.append(f"model.seq_length: checkpoint {saved['seq_length']}, this run {model['seq_length']} ({why})")
    return out


def adopt_checkpoint_model(cfg, overrides: list[str], model_choice: str | None, saved: dict | None = None) -> list[str]:
    """Make ``cfg.model`` the model of the checkpoint ``checkpoint.load`` names, with the run's own training
    keys on top; ConfigError naming every architectural key the run sets against it. Returns the keys
    taken from the checkpoint (empty: nothing to load, or the run names its whole model). ``saved``: the
    model section of the state the run starts from when it is not read from ``checkpoint.load`` (a state
    of the node-local tier, which restores without reading the shared tier)."""
    if not cfg.checkpoint.get("load"):
        return []
    if saved is None:
        saved = saved_model(cfg.checkpoint.load)
    if saved is None:
        return []
    unknown = sorted(set(saved) - MODEL_FIELDS)
    if unknown:
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load}: its model has key(s) this build does not know: "
                          f"{', '.join('model.' + k for k in unknown)}")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    given = given_model_keys(cfg, overrides, model_choice)
    bad = contradictions(saved, model, MODEL_FIELDS if given is None else given)
    if bad:
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load} holds another model than this run sets: "
                          + "; ".join(bad) + " (leave the model keys out to train the checkpoint's model)")
    if given is None:
        return []
    taken = sorted(k for k in saved if k not in given and saved[k] != model.get(k))
    for k in taken:
        cfg.model[k] = saved[k]
    return taken
