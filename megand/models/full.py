"""The whole model in one process, from full tensors or from a checkpoint of any layout (tools and tests)."""

from __future__ import annotations

from dataclasses import fields

import os

import torch
from omegaconf import OmegaConf

from megand.core.checkpointing import CheckpointError
from megand.core.checkpointing.files import resolve
from megand.core.checkpointing.offline import load_full_tensors, single_process_topology
from megand.core.sharding import init_parameters
from megand.core.tensor_parallel import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.models.gpt import GPTModel


def transformer_config(model_cfg: dict) -> TransformerConfig:
    """The fp32, one-process TransformerConfig of a ``model`` section (as stored with a checkpoint)."""
    names = {f.name for f in fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in dict(model_cfg).items() if k in names})


def read_config(path: str):
    """The run configuration stored with the checkpoint (OmegaConf)."""
    return OmegaConf.load(os.path.join(resolve(path), "config.yaml"))


def build_full_model(model_cfg, tensors: dict[str, torch.Tensor] | None = None, topo=None, seed: int = 1234):
    """A one-process GPTModel for ``model_cfg`` (a dict or the ``model`` group), in fp32, loaded with
    ``tensors`` (full weights by name) when given."""
    topo = topo or single_process_topology()
    cfg = transformer_config(model_cfg)
    model = GPTModel(cfg, topo, TensorParallelRNG(seed, 0, topo.device))
    init_parameters(model, seed)
    if tensors is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                key = param.meta.copy_of or name
                if key not in tensors:
                    raise CheckpointError(f"tensor {key} is missing from the checkpoint")
                if tuple(tensors[key].shape) != tuple(param.meta.full_shape):
                    raise CheckpointError(f"tensor {key}: expected shape {tuple(param.meta.full_shape)}, "
                                          f"checkpoint has {tuple(tensors[key].shape)}")
                param.copy_(tensors[key])
    return model.eval()


def load_model(path: str, topo=None):
    """(model, run config) from a megand checkpoint at any layout, in one process."""
    run_cfg = read_config(path)
    return build_full_model(OmegaConf.to_container(run_cfg.model, resolve=True), load_full_tensors(path), topo), run_cfg
