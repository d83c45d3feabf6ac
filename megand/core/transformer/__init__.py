"""Transformer building blocks: config, attention, MLP, norms, RoPE, layer."""

from megand.core.transformer.config import TransformerConfig
from megand.core.transformer.layer import TransformerLayer
