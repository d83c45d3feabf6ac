"""Regional compilation (``train.compile=true``): each transformer layer is compiled on its own with
``torch.compile`` (as torchtitan does), not the whole model. Identical layers share one compiled graph,
compilation stays short, and what runs between layers (embedding, pipeline p2p, the loss, the
data-parallel hooks) is untouched, so it composes with every parallel layout and with recomputation.

Compilation is lazy: the first forward and backward of each layer compile. The time that takes is
measured per layer (its first call) and reported once by the trainer."""

from __future__ import annotations

import time

import torch


class CompileTimer:
    """Wall time of each compiled layer's first forward call (which compiles it)."""

    def __init__(self):
        self.seconds = 0.0
        self.reported = False

    def wrap(self, compiled):
        first = [True]

        def call(*args, **kwargs):
            if not first[0]:
                return compiled(*args, **kwargs)
            start = time.perf_counter()
            out = compiled(*args, **kwargs)
            first[0] = False
            self.seconds += time.perf_counter() - start
            return out

        return call


def compile_layers(chunks) -> CompileTimer:
    """Compile the body of every transformer layer of ``chunks`` (:meth:`TransformerLayer.compile_body`);
    return the timer that accumulates their first-call (compilation) time. The module hooks stay outside
    the compiled code. Activation recomputation runs eagerly (its checkpoint replays the tensor-parallel
    RNG, which torch.compile cannot trace): under full recomputation the recomputed body of the layer is
    what is compiled. Nothing outside the layers changes: the choice is each layer's own."""
    timer = CompileTimer()
    for chunk in chunks:  # the main model's layers and each multi-token prediction depth's
        depths = chunk.mtp.depths if getattr(chunk, "mtp", None) is not None else []
        for layer in [*chunk.layers.values(), *(depth.layer for depth in depths)]:
            layer.compile_body(lambda body: timer.wrap(torch.compile(body)), eager=torch.compiler.disable)
    return timer
