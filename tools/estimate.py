"""Estimate per-rank memory (parameters, optimizer states, activations) for a run's config and layout.

The model and layout are the training config: Hydra overrides, composed exactly as ``pretrain_gpt.py``
composes them (``model=`` picks a conf/model preset, ``+experiment=`` a whole experiment):

    python tools/estimate.py model=llama_8b parallel.tp=8 parallel.sequence_parallel=true \\
        train.recompute=selective train.precision=bf16 --world-size 64
    python tools/estimate.py +experiment=llama70b_64gpu --world-size 64 --json

``--world-size`` fills ``parallel.dp: null`` (default: tp·pp·cp, i.e. dp=1). The formulas and what they
leave out are documented in megand/tools/estimate_memory.py.
"""

import sys

from megand.tools.estimate import main

if __name__ == "__main__":
    sys.exit(main())
