"""GPTModel: GPT-2 style or LLaMA style from one config, built for one pipeline stage (or model chunk).

A stage holds a contiguous range of layers; the first stage also holds the embeddings, the last the
final norm and output layer. Parameter names use global layer indices (``layers.7.mlp.fc1.weight``),
so every chunk's names are those of the full model: initialisation and checkpoints are layout-free.
Activations between layers are ``[seq, batch, hidden]``, sequence-sharded under sequence parallelism.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.sharding import EMBEDDING, OUTPUT, ParamMeta, retag, split_by_tokens, tag
from megand.core.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    vocab_parallel_cross_entropy,
)
from megand.core.tensor_parallel.layers import column_parallel_linear, vocab_parallel_lookup
from megand.core.transformer import TransformerConfig, TransformerLayer
from megand.core.transformer.norms import Norm
from megand.core.transformer.per_layer_input import PerLayerProjection, embedding_scale
from megand.core.transformer.rope import rope_cos_sin
from megand.models.mtp import MultiTokenPrediction, depth_losses, shift_left


def seq_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...] -> [s, b, ...]``, contiguous, with the strides of a new tensor of that shape. A batch of
    one is contiguous as soon as it is transposed, so ``.contiguous()`` alone keeps the transposed strides
    (``s*h`` for its size-1 batch dim), while the layers' outputs have ``h``: torch.compile guards on
    strides, and the first layer would compile a graph of its own (``.view`` recomputes them, no copy)."""
    return x.transpose(0, 1).contiguous().view(x.shape[1], x.shape[0], *x.shape[2:])

WORD_EMBEDDING = "embedding.word.weight"


class Embedding(torch.nn.Module):
    def __init__(self, cfg: TransformerConfig, topo, rng, device):
        super().__init__()
        self.cfg, self.tp_group, self.rng = cfg, topo.tp_group, rng
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group=topo.tp_group,
                                           init_std=cfg.init_std, padded_size=cfg.padded_vocab_size(topo.tp_size),
                                           dtype=cfg.params_dtype, device=device)
        self.position = None
        if cfg.position_embedding == "learned":
            shape = (cfg.seq_length, cfg.hidden_size)
            # under sequence parallelism each tp rank adds the rows of its sequence shard: partial gradients
            meta = ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=cfg.init_std,
                             input_split=split_by_tokens(cfg.sequence_parallel), role=EMBEDDING)
            self.position = tag(torch.nn.Parameter(torch.empty(shape, dtype=cfg.params_dtype, device=device)), meta)

    def scale(self, x):
        """Gemma's embedding scale: times sqrt(hidden), a factor rounded to the table's dtype as Gemma rounds it."""
        if not self.cfg.embedding_scale:
            return x
        return x * embedding_scale(self.cfg.hidden_size, self.word.weight.dtype)

    def forward(self, input_ids, positions):
        if self.cfg.sequence_parallel:
            # each tp rank's lookup is partial (its vocab rows): reduce-scatter the sum over the sequence
            # (no all-reduce of the full sequence then a split)
            x = self.scale(reduce_scatter_to_sp(seq_first(self.word(input_ids)), self.tp_group))  # [s/tp, b, h]
            if self.position is not None:
                local = positions.chunk(dist.get_world_size(self.tp_group))[dist.get_rank(self.tp_group)]
                x = x + self.position[local].unsqueeze(1)
        else:
            x = self.scale(reduce_from_tp(self.word(input_ids), self.tp_group))  # [b, s, h]
            if self.position is not None:
                x = x + self.position[positions]
            x = seq_first(x)  # [s, b, h]
        if self.training and self.cfg.hidden_dropout > 0:
            if self.cfg.sequence_parallel:  # each tp rank holds other tokens: draw other masks
                with self.rng.fork():
                    return F.dropout(x, self.cfg.hidden_dropout)
            x = F.dropout(x, self.cfg.hidden_dropout)
        return x


class GPTModel(torch.nn.Module):
    def __init__(self, cfg: TransformerConfig, topo, rng, layer_ids=None, pre_process=True, post_process=True,
                 device=None, recompute_ids=None):
        """``device``: where the parameters are created (default ``topo.device``). On ``meta`` nothing is
        allocated: the data-parallel engine later places the parameters in its buffers.
        ``recompute_ids``: the layers that apply ``cfg.recompute`` (the others store their activations);
        None: every layer."""
        super().__init__()
        device = topo.device if device is None else device
        self.cfg, self.topo = cfg, topo
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(range(cfg.num_layers) if layer_ids is None else layer_ids)
        self.embedding = Embedding(cfg, topo, rng, device) if pre_process else None
        # per-layer input embeddings: the word embedding's part of every layer's input, made where it is
        self.per_layer_inputs = PerLayerProjection(cfg, topo, device) if pre_process and cfg.per_layer_input_size else None
        stored = dataclasses.replace(cfg, recompute="none")  # the layers that keep their activations
        self.layers = torch.nn.ModuleDict({
            str(i): TransformerLayer(cfg if recompute_ids is None or i in recompute_ids else stored, topo, rng, device,
                                     layer_id=i)
            for i in self.layer_ids})
        self.final_norm = self.output_layer = None
        if post_process:
            self.final_norm = Norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps,
                                   input_split=split_by_tokens(cfg.sequence_parallel),
                                   tp_rank=topo.tp_rank, tp_size=topo.tp_size, dtype=cfg.params_dtype, device=device,
                                   unit_offset=cfg.norm_unit_offset)
            if not (cfg.tie_embeddings and pre_process):
                self.output_layer = ColumnParallelLinear(
                    cfg.hidden_size, cfg.vocab_size, tp_group=topo.tp_group, bias=False,
                    sequence_parallel=cfg.sequence_parallel, init_std=cfg.init_std,
                    padded_out=cfg.padded_vocab_size(topo.tp_size), dtype=cfg.params_dtype, device=device,
                    role=OUTPUT)
                if cfg.tie_embeddings:  # a later stage's copy of the first stage's word embedding
                    retag(self.output_layer.weight, copy_of=WORD_EMBEDDING, embedding_group_grad=True, role=EMBEDDING)
        # multi-token prediction (last stage): its depths look tokens up in the word embedding, a copy of it
        # on a later stage (the tied output layer's weight, else a table of its own) kept equal as tied weights are
        self.mtp = self.mtp_embedding = None
        if post_process and cfg.mtp_layers:
            self.mtp = MultiTokenPrediction(cfg, topo, rng, device)
            if not pre_process and not cfg.tie_embeddings:
                self.mtp_embedding = VocabParallelEmbedding(
                    cfg.vocab_size, cfg.hidden_size, tp_group=topo.tp_group, init_std=cfg.init_std,
                    padded_size=cfg.padded_vocab_size(topo.tp_size), dtype=cfg.params_dtype, device=device)
                retag(self.mtp_embedding.weight, copy_of=WORD_EMBEDDING, embedding_group_grad=True, role=EMBEDDING)
        if pre_process and not post_process and (cfg.tie_embeddings or cfg.mtp_layers):
            retag(self.embedding.word.weight, embedding_group_grad=True)
        self.vocab_start = topo.tp_rank * cfg.padded_vocab_size(topo.tp_size) // topo.tp_size

    @property
    def reads_tokens(self) -> bool:
        """Whether this chunk's forward reads the token ids: the first stage, and every stage when its layers look
        up per-layer input embeddings."""
        return self.pre_process or bool(self.cfg.per_layer_input_size)

    def borrowed_parameters(self):
        """Parameters of submodules that this module's own forward reads (the data-parallel engine
        gathers them for it under ZeRO-3): the word embedding when the output layer is tied to it here;
        with multi-token prediction the output layer's weight and the table its depths look tokens up in."""
        if self.mtp is not None:
            return list({id(w): w for w in (self.output_weight, self.mtp_table)}.values())
        tied_here = self.post_process and self.output_layer is None
        return [self.embedding.word.weight] if tied_here else []

    @property
    def output_weight(self):
        return self.embedding.word.weight if self.output_layer is None else self.output_layer.weight

    @property
    def mtp_table(self):
        """The word embedding (or this stage's copy of it) that multi-token prediction looks tokens up in."""
        if self.pre_process:
            return self.embedding.word.weight
        return self.output_layer.weight if self.mtp_embedding is None else self.mtp_embedding.weight

    def embed_tokens(self, ids):
        """The word embedding of ``ids [b, s]`` alone, ``[s, b, h]`` (this rank's sequence shard under sp)."""
        partial = seq_first(vocab_parallel_lookup(ids, self.mtp_table, self.topo.tp_group))
        if self.cfg.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.topo.tp_group)
        return reduce_from_tp(partial, self.topo.tp_group)

    def logits(self, x):
        """This rank's vocab slice of the logits ``[s, b, V_local]`` (soft-capped: ``model.final_logit_softcapping``,
        elementwise, so each rank caps its own slice)."""
        if self.output_layer is not None:
            logits = self.output_layer(x)
        else:
            # tied to the word embedding on this stage: the same column-parallel product, on its weight (which
            # the embedding's lookup reads too, so autograd sums the two gradients before they are accumulated)
            logits = column_parallel_linear(x, self.embedding.word.weight, None, self.topo.tp_group,
                                            self.cfg.sequence_parallel, fuse_wgrad=False)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rope(self, positions):
        """The RoPE tables by kind, ``{"global": (cos, sin)}`` and with a local base ``"local"`` too (each layer
        reads its own: :meth:`TransformerConfig.layer_rope`); None without rotary embedding."""
        cfg = self.cfg
        if cfg.position_embedding != "rope":
            return None
        tables = {"global": rope_cos_sin(positions, cfg.global_rope_dim, cfg.rope_theta, cfg.rope_scaling)}
        if cfg.rope_local_theta is not None:  # the sliding-window layers' own base, without scaling
            tables["local"] = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_local_theta)
        elif cfg.local_rope:  # the global RoPE at the sliding layers' own head width
            tables["local"] = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        return tables

    def forward(self, input_ids=None, positions=None, labels=None, hidden=None, kv_cache=None, documents=None):
        """First stage: ``input_ids [b, s]``; other stages: ``hidden`` from the previous stage.

        With per-layer input embeddings the hidden states between stages carry every layer's projected word
        embedding after the hidden size (``[s, b, h + L·p]``, :attr:`TransformerConfig.pipeline_width`) and every
        stage reads ``input_ids`` (its layers look their own tables up).

        Returns the hidden states ``[s, b, h]`` unless this is the last stage, where it returns the
        per-token loss ``[b, s]`` when ``labels`` are given, else the logits ``[b, s, vocab]``. With
        multi-token prediction a training forward with ``labels`` returns ``(loss, mtp_loss)`` instead
        (:meth:`loss_with_mtp`); evaluation and generation never run the depths.
        ``positions [s]`` are the global indices of the local tokens (they differ under context parallelism),
        or ``[b, s]`` per-sample positions (restarting at each document).
        ``documents``: a :class:`~megand.core.transformer.documents.DocumentMask` of the micro-batch's
        full sequence: attention stays within documents.
        ``kv_cache``: a :class:`~megand.core.transformer.kv_cache.KVCache` (generation): ``input_ids`` are
        the tokens after the cached ones, at positions from the cache's length on.
        """
        if kv_cache is not None and positions is None:
            positions = torch.arange(kv_cache.length, kv_cache.length + input_ids.shape[1], device=self.topo.device)
        if positions is None:
            s = input_ids.shape[1] if input_ids is not None else hidden.shape[0] * (
                self.topo.tp_size if self.cfg.sequence_parallel else 1)
            positions = torch.arange(s, device=self.topo.device)
        x = self.embedding(input_ids, positions) if self.pre_process else hidden
        projected = None  # per-layer input embeddings: the projected word embedding, every layer's columns
        if self.per_layer_inputs is not None:
            projected = self.per_layer_inputs(x)
        elif self.cfg.per_layer_input_size:  # it came with the hidden state
            x, projected = x.split([self.cfg.hidden_size, self.cfg.per_layer_inputs_width], dim=-1)
        rope = self.rope(positions)
        shared = {} if self.cfg.num_kv_shared_layers else None  # keys and values layers share (by layer id)
        for name, layer in self.layers.items():
            per_layer = None
            if projected is not None:
                p = self.cfg.per_layer_input_size
                per_layer = (input_ids, projected[..., int(name) * p: (int(name) + 1) * p])
            x = layer(x, rope, kv_cache.layers[name] if kv_cache is not None else None, documents, shared, per_layer)
        if not self.post_process:
            return x if projected is None else torch.cat([x, projected], dim=-1)

        if self.mtp is not None and labels is not None and self.training:
            return self.loss_with_mtp(x, labels, rope, documents)
        logits = self.logits(self.final_norm(x))
        if labels is None:  # the padding columns are cut off: generation never picks them
            full = gather_from_tp(logits, self.topo.tp_group)[..., : self.cfg.vocab_size]
            return full.transpose(0, 1).float()
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.topo.tp_group,
                                            self.vocab_start, self.cfg.vocab_size, consume=True)
        return loss.transpose(0, 1)

    def loss_with_mtp(self, x, labels, rope, documents):
        """Training with multi-token prediction: ``(loss [b, s], mtp_loss [D, b, s])``, the main per-token loss
        and each depth's, put at its target label's position (:func:`megand.models.mtp.depth_losses`).

        The main model's and every depth's logits are one product with the output layer's weight: the weight
        (and the word embedding the depths read) are used several times in one backward, so their gradients
        must reach the data-parallel engine once, summed by autograd (``fuse_wgrad=False``)."""
        cfg, tp_group = self.cfg, self.topo.tp_group
        main = self.final_norm(x)
        normed = [main] + self.mtp(main, labels, self.embed_tokens, rope, documents)
        depths = len(normed)
        logits = column_parallel_linear(torch.cat(normed), self.output_weight, None, tp_group, cfg.sequence_parallel,
                                        fuse_wgrad=False)  # [(1 + D) s, b, V/tp], depth-major
        targets = torch.stack([shift_left(labels, k) for k in range(depths)]).transpose(1, 2)  # [1 + D, s, b]
        if cfg.sequence_parallel:  # the gathered rows are rank-major: each tp rank's shards of every depth
            tp = self.topo.tp_size
            targets = targets.unflatten(1, (tp, -1)).transpose(0, 1)  # [tp, 1 + D, s/tp, b]
        loss = vocab_parallel_cross_entropy(logits, targets.reshape(-1, targets.shape[-1]), tp_group,
                                            self.vocab_start, cfg.vocab_size, consume=True)
        loss = loss.view(targets.shape)
        if cfg.sequence_parallel:
            loss = loss.transpose(0, 1).flatten(1, 2)
        loss = loss.transpose(1, 2)  # [1 + D, b, s]
        return loss[0], torch.stack([depth_losses(loss[k], k) for k in range(1, depths)])
