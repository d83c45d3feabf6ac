"""The whole model in one process, from full tensors or from a checkpoint of any layout (tools and tests)."""

from __future__ import annotations

import os
import torch
from omegaconf import OmegaConf

from megand.core.checkpointing import CheckpointError
from megand.core.checkpointing.files import resolve
from megand.core.checkpointing.offline import (
    load_full_tensors,
    save_model_streaming,
    single_process_topology,
)
from megand.core.checkpointing.sharded import state_buffers, unpadded
from megand.core.sharding import ParamMeta, full_name, init_parameters, tile_seed
from megand.core.tensor_parallel import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.models.gpt import GPTModel


def transformer_config(model_cfg: dict) -> TransformerConfig:
    """The fp32, one-process TransformerConfig of a ``model`` section (as stored with a checkpoint)."""
    return TransformerConfig.from_model(dict(model_cfg))


def param_metas(model_cfg) -> dict[str, ParamMeta]:
    """Name -> ParamMeta of every tensor a checkpoint of ``model_cfg`` holds, read from the model's own
    parameters built on the meta device (nothing is allocated)."""
    cfg = transformer_config(model_cfg)
    model = GPTModel(cfg, single_process_topology(torch.device("meta")), TensorParallelRNG(0, 0, torch.device("meta")))
    return {name: p.meta for name, p in model.named_parameters() if p.meta.copy_of is None}


def full_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Name -> full (unpadded) shape of every parameter a checkpoint of ``model_cfg`` holds."""
    return {name: tuple(meta.full_shape) for name, meta in param_metas(model_cfg).items()}


def checkpoint_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """:func:`full_shapes` and the persistent buffers' shapes (e.g. the sigmoid router's expert bias, which
    checkpoint adapters carry too)."""
    return {**full_shapes(model_cfg), **{k: tuple(v.shape) for k, v in buffer_values(model_cfg).items()}}


def buffer_values(model_cfg) -> dict[str, torch.Tensor]:
    """Name -> initial value of every persistent buffer a checkpoint of ``model_cfg`` holds (small: built on
    the CPU with the model's parameters on the meta device)."""
    cfg = transformer_config(model_cfg)
    model = GPTModel(cfg, single_process_topology(torch.device("meta")), TensorParallelRNG(0, 0, torch.device("meta")))
    return {name: torch.zeros(buf.shape, dtype=buf.dtype) for name, buf in state_buffers([model])}


def save_random_model(save_dir: str, model_cfg: dict, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """A model-only checkpoint of random weights (benchmarks and tests), written one tensor at a time:
    matrices N(0, init_std), norm weights 1 + N(0, 0.1), biases N(0, 0.1) (not the training init's ones and
    zeros, so that a misplaced norm or bias shows). Returns the iteration directory."""
    metas = param_metas(model_cfg)

    def produce(name):
        meta = metas[name]
        generator = torch.Generator().manual_seed(tile_seed(seed, name, 0))  # one draw per tensor
        noise = torch.randn(meta.full_shape, generator=generator)
        if meta.init == "normal":
            noise.mul_(meta.init_std)
        else:
            noise.mul_(0.1).add_(1.0 if meta.init == "ones" else 0.0)
        return noise.to(dtype)

    shapes = {name: (tuple(meta.full_shape), dtype) for name, meta in metas.items()}
    buffers = buffer_values(model_cfg)  # as initialised (the router bias: zeros), in their own dtype
    shapes.update({name: (tuple(b.shape), b.dtype) for name, b in buffers.items()})
    produce_param = produce

    def produce(name):
        return buffers[name] if name in buffers else produce_param(name)

    config_yaml = OmegaConf.to_yaml({"model": dict(model_cfg)})
    return save_model_streaming(save_dir, shapes, produce, config_yaml, dict(model_cfg))


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
                key = full_name(name, param.meta)
                if key not in tensors:
                    raise CheckpointError(f"tensor {key} is missing from the checkpoint")
                if tuple(tensors[key].shape) != tuple(param.meta.full_shape):
                    raise CheckpointError(f"tensor {key}: expected shape {tuple(param.meta.full_shape)}, "
                                          f"checkpoint has {tuple(tensors[key].shape)}")
                unpadded(param, param.meta).copy_(tensors[key][param.meta.local_slice()])  # padding rows stay zero
            for name, buf in state_buffers([model]):  # e.g. the MoE router's balancing bias
                if name not in tensors:
                    raise CheckpointError(f"tensor {name} is missing from the checkpoint")
                buf.copy_(tensors[name])
    return model.eval()


def load_model(path: str, topo=None):
    """(model, run config) from a megand checkpoint at any layout, in one process."""
    run_cfg = read_config(path)
    return build_full_model(OmegaConf.to_container(run_cfg.model, resolve=True), load_full_tensors(path), topo), run_cfg
