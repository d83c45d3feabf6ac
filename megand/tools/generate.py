"""Generate text from a megand checkpoint (any layout), in one process.

    python tools/generate.py --load ckpts/run --prompt "Once upon a time" --tokenizer tok.model --max-new-tokens 50
    python tools/generate.py --load ckpts/run --ids 5 17 42 --max-new-tokens 20            # greedy, token ids
    python tools/generate.py --load ckpts/run --ids 5 17 --temperature 0.8 --top-k 40 --seed 1

Greedy by default (temperature 0); with a temperature, samples from the (top-k) softmax. The model sees
at most `model.seq_length` tokens (the most recent ones) per step. Prints the text (with a tokenizer) or
the ids, prompt included.
"""

import argparse
import sys


import torch

from megand.core.checkpointing import CheckpointError
from megand.models import full


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             generator: torch.Generator | None = None, eos_id: int | None = None,
             vocab_limit: int | None = None) -> list[int]:
    """``ids`` extended by up to ``max_new_tokens`` tokens (no KV cache: each step re-reads the window).
    ``vocab_limit``: only ids below it are generated (a tokenizer smaller than the model's vocab)."""
    ids = list(ids)
    window = model.cfg.seq_length
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long)
        logits = model(input_ids=context)[0, -1, :vocab_limit]  # [vocab], fp32
        if temperature <= 0:
            token = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        ids.append(token)
        if eos_id is not None and token == eos_id:
            break
    return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megand save dir (with `latest`) or iteration dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    src.add_argument("--ids", type=int, nargs="+", help="prompt token ids")
    p.add_argument("--tokenizer", help="sentencepiece .model (default: the run's data.tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the tokenizer's EOS")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        model, run_cfg = full.load_model(args.load)
    except CheckpointError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    tok_path = args.tokenizer or (run_cfg.get("data", {}) or {}).get("tokenizer")
    if args.prompt is not None or (tok_path and args.tokenizer):
        if not tok_path:
            p.error("--prompt needs --tokenizer (or a checkpoint whose run set data.tokenizer)")
        from megand.data.tokenizer import SentencePieceTokenizer

        tokenizer = SentencePieceTokenizer(tok_path)
    ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.ids
    if not ids or max(ids) >= model.cfg.vocab_size or min(ids) < 0:
        p.error(f"prompt ids must be non-empty and in [0, {model.cfg.vocab_size})")
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                   torch.Generator().manual_seed(args.seed),
                   tokenizer.eos_id if (tokenizer and args.stop_at_eos) else None,
                   tokenizer.vocab_size if tokenizer else None)
    print(tokenizer.decode(out) if tokenizer else " ".join(map(str, out)))
    return 0

