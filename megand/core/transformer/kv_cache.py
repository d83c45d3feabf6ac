"""KV cache for incremental decoding (generation, one process): the keys and values of the tokens seen so
far, per layer, and attention of new queries over them."""

import torch
import torch.nn.functional as F

from megand.core.attention_masks import local_attention


class LayerKVCache:
    """One layer's keys and values ``[b, groups, max_len, d]`` of the tokens seen so far."""

    def __init__(self, batch: int, groups: int, max_len: int, head_dim: int, dtype, device, v_dim: int | None = None):
        self.k = torch.empty(batch, groups, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(batch, groups, max_len, head_dim if v_dim is None else v_dim, dtype=dtype, device=device)
        self.length = 0
        self.index_k = None  # DeepSeek Sparse Attention: the indexer keys [max_len, b, d] (made on first use)

    def append_index(self, k: torch.Tensor) -> torch.Tensor:
        """Store the indexer keys ``[s, b, d]`` of the tokens ``append`` just stored; return every token's."""
        if self.index_k is None:
            self.index_k = torch.empty(self.k.shape[2], *k.shape[1:], dtype=k.dtype, device=k.device)
        self.index_k[self.length - k.shape[0]: self.length] = k
        return self.index_k[: self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k``/``v`` ``[b, groups, s, d]`` after the cached tokens; return every token's k and v."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.k.shape[2]}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class LayerRecurrentCache:
    """One Gated DeltaNet layer's state: its convolution's last K-1 inputs and its recurrent state (fixed size,
    whatever the number of tokens seen)."""

    def __init__(self, layer, batch: int, device):
        self.state = layer.zero_state(batch, torch.float32, device)
        self.length = 0

    def update(self, state, tokens: int) -> None:
        self.state, self.length = state, self.length + tokens


class KVCache:
    """Per-layer caches for incremental decoding (one process, no tensor/context parallelism). Under latent
    attention a layer caches its normalised latent ``[b, 1, len, kv_lora_rank]`` as "k" and its rotated shared
    key ``[b, 1, len, qk_rope_head_dim]`` as "v" (the layer expands them into every head's keys and values). A
    layer that reads an earlier layer's keys and values (model.num_kv_shared_layers) has that layer's cache."""

    def __init__(self, cfg, batch: int, max_len: int, dtype, device, layer_ids, layers=None):
        """``layers``: the model's layers by id (a Gated DeltaNet layer sizes its own recurrent cache)."""
        self.layers = {}
        for i in layer_ids:
            shape = cfg.layer_config(i)  # a full-attention layer's own head width and key/value heads
            groups, k_dim, v_dim = ((1, cfg.kv_lora_rank, cfg.qk_rope_head_dim) if cfg.multi_latent
                                    else (shape.query_groups, shape.head_dim, shape.head_dim))
            if cfg.kv_source(i) is not None:  # it reads an earlier layer's keys and values: that layer's cache
                self.layers[str(i)] = self.layers[str(cfg.kv_source(i))]
            elif cfg.is_linear_attention(i):
                self.layers[str(i)] = LayerRecurrentCache(layers[str(i)].attention, batch, device)
            else:
                self.layers[str(i)] = LayerKVCache(batch, groups, max_len, k_dim, dtype, device, v_dim)

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length if self.layers else 0


def cached_attention(q, k, v, window=None, sinks=None):
    """Attention of the new queries ``[b, heads, s_new, d]`` over every cached key/value ``[b, groups, s, d]``:
    query i is the token at position ``s - s_new + i`` and sees the keys up to it (the ``window`` latest
    with sliding-window attention; ``sinks``: each head's sink logit)."""
    s_new, s = q.shape[2], k.shape[2]
    if s_new == 1 and (window is None or window >= s) and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
    return local_attention(q, k, v, window, sinks=sinks)
