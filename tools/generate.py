"""Generate text from a megand checkpoint (any layout), in one process.

    python tools/generate.py --load ckpts/run --prompt "Once upon a time" --tokenizer tok.model --max-new-tokens 50
    python tools/generate.py --load ckpts/run --ids 5 17 42 --max-new-tokens 20            # greedy, token ids
    python tools/generate.py --load ckpts/run --ids 5 17 --temperature 0.8 --top-k 40 --seed 1

Greedy by default (temperature 0); with a temperature, samples from the (top-k) softmax. Decoding keeps a
KV cache (each new token costs one position; --no-kv-cache re-reads the whole window per token). Runs on
the GPU in bf16 when one is available, else on the CPU in fp32. The model sees at most
`model.seq_length` tokens: past that, each step re-reads the most recent window. Prints the text (with a
tokenizer) or the ids, prompt included; tokens/s goes to stderr. Without --tokenizer, the run's
`data.tokenizer` is used, found relative to the directory the run was launched from.
"""

import sys

from megand.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
