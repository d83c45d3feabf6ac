"""Convert between megand checkpoints (any parallel layout) and Hugging Face ``transformers`` directories.

    python tools/convert_checkpoint.py export --load ckpts/run --out hf/run [--dtype fp32] [--max-shard-size 5GB]
        megand checkpoint (a save dir with `latest`, or an iter_NNNNNNN dir) -> LlamaForCausalLM (llama) or
        GPT2LMHeadModel (gpt): safetensors shards (+ model.safetensors.index.json when there are several)
        and config.json
    python tools/convert_checkpoint.py import --hf hf/run --save ckpts/imported [--dtype fp32]
        local transformers directory (safetensors) -> megand checkpoint (model only, iteration 0), loadable
        at any layout with `checkpoint.load=ckpts/imported`

Both directions stream: one tensor is read, converted and written at a time (peak memory about the
largest tensor plus one output shard), shapes are checked from the config before any tensor is read,
and no model is built. Export writes bf16 unless --dtype says otherwise (a checkpoint holds fp32 weights);
import keeps the dtype of the files unless --dtype is given. An existing checkpoint
directory (import) or a non-empty output directory (export) is refused unless --force.
"""

import sys

from megand.tools.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
