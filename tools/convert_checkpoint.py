"""Convert between megand checkpoints (any parallel layout) and Hugging Face ``transformers`` directories.

    python tools/convert_checkpoint.py export --load ckpts/run --out hf/run
        megand checkpoint (a save dir with `latest`, or an iter_NNNNNNN dir) -> LlamaForCausalLM (llama) or
        GPT2LMHeadModel (gpt) as safetensors + config.json
    python tools/convert_checkpoint.py import --hf hf/run --save ckpts/imported
        transformers directory -> megand checkpoint (model only, iteration 0), loadable at any layout with
        `checkpoint.load=ckpts/imported`
"""

import sys

from megand.tools.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
