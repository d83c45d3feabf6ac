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

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from megand.core.checkpointing import CheckpointError, files, offline
from megand.core.parallel_state import choose_device_and_backend
from megand.core.transformer.kv_cache import KVCache
from megand.models import full


def _next_token(logits, temperature: float, top_k: int, generator) -> int:
    logits = logits.float()
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             generator: torch.Generator | None = None, eos_id: int | None = None,
             vocab_limit: int | None = None, kv_cache: bool = True) -> list[int]:
    """``ids`` extended by up to ``max_new_tokens`` tokens. ``vocab_limit``: only ids below it are
    generated (a tokenizer smaller than the model's vocab). With ``kv_cache`` the keys and values of earlier
    tokens are kept; once the sequence is longer than the window each step re-reads the last window (the
    positions of every token shift), exactly as without the cache."""
    ids = list(ids)
    window = model.cfg.seq_length
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = None
    for _ in range(max_new_tokens):
        if kv_cache and cache is not None and len(ids) <= window:
            logits = model(input_ids=torch.tensor([ids[-1:]], device=device), kv_cache=cache)
        else:  # first step, no cache, or past the window: the whole (last) window
            context = torch.tensor([ids[-window:]], device=device)
            cache = KVCache(model.cfg, 1, window, dtype, device, model.layer_ids, model.layers) if kv_cache else None
            logits = model(input_ids=context, kv_cache=cache)
        token = _next_token(logits[0, -1, :vocab_limit], temperature, top_k, generator)
        ids.append(token)
        if eos_id is not None and token == eos_id:
            break
    return ids


def stored_tokenizer_path(load: str, run_cfg) -> str | None:
    """The run's ``data.tokenizer`` (or, when that is null, the tokenizer its data source brought itself:
    the quickstart's), as a path that exists from here.

    A relative path was relative to the directory the run was launched from. ``checkpoint.save`` was given
    from that same directory, so the launch directory is what remains of the checkpoint's absolute path
    once that relative ``checkpoint.save`` is taken off its end."""
    from megand.data.source import DATA_KINDS

    data = run_cfg.get("data", {}) or {}
    stored = data.get("tokenizer")
    if not stored and data.get("kind") in DATA_KINDS:
        stored = DATA_KINDS[data["kind"]].tokenizer_of(data, (run_cfg.get("model", {}) or {}).get("vocab_size"))
    if not stored or os.path.isabs(stored):
        return stored
    candidates = []
    save = (run_cfg.get("checkpoint", {}) or {}).get("save")
    if save and not os.path.isabs(save):
        save_dir = os.path.dirname(os.path.abspath(files.resolve(load)))
        depth = len(os.path.normpath(save).split(os.sep))
        if save_dir.endswith(os.sep + os.path.normpath(save)):
            launch_dir = save_dir
            for _ in range(depth):
                launch_dir = os.path.dirname(launch_dir)
            candidates.append(os.path.join(launch_dir, stored))
    candidates.append(os.path.abspath(stored))
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the run's data.tokenizer={stored} is not found (looked at {', '.join(candidates)}): "
                            f"pass --tokenizer")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megand save dir (with `latest`) or iteration dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--ids", type=int, nargs="+", help="prompt token ids")
    p.add_argument("--tokenizer", help="sentencepiece .model, tokenizer.json or .tiktoken file (default: the run's data.tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the tokenizer's EOS")
    p.add_argument("--no-kv-cache", action="store_true", help="re-read the whole window for every token")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error(f"--max-new-tokens={args.max_new_tokens}: must be >= 0")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        print(f"generate: --tokenizer {args.tokenizer}: no such file", file=sys.stderr)
        return 2
    device, _ = choose_device_and_backend()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        run_cfg = full.read_config(args.load)
        tok_path = args.tokenizer or (stored_tokenizer_path(args.load, run_cfg) if args.prompt is not None else None)
        if args.prompt is not None and not tok_path:
            raise FileNotFoundError("--prompt needs --tokenizer (the checkpoint's run set no data.tokenizer)")
        model, run_cfg = full.load_model(args.load, offline.single_process_topology(device))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    model = model.to(dtype)
    tokenizer = None
    if tok_path:
        from megand.data.errors import DataError
        from megand.data.tokenizer import load_tokenizer

        run_data = (run_cfg.get("data", {}) or {}) if not args.tokenizer else {}
        try:  # any tokenizer kind; the run's data.tokenizer_type when its tokenizer is used
            tokenizer = load_tokenizer(tok_path, run_data.get("tokenizer_type"))
        except DataError as e:
            print(f"generate: {e}", file=sys.stderr)
            return 2
        if tokenizer.vocab_size > model.cfg.vocab_size:
            print(f"generate: warning: tokenizer {tok_path} has {tokenizer.vocab_size} tokens, more than the model's "
                  f"vocab_size={model.cfg.vocab_size}: its ids >= {model.cfg.vocab_size} cannot be used (is it this model's "
                  f"tokenizer?)", file=sys.stderr)
    ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.ids
    if not ids or max(ids) >= model.cfg.vocab_size or min(ids) < 0:
        p.error(f"prompt ids must be non-empty and in [0, {model.cfg.vocab_size})")
    start = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                   torch.Generator().manual_seed(args.seed),
                   tokenizer.eos_id if (tokenizer and args.stop_at_eos) else None,
                   min(tokenizer.vocab_size, model.cfg.vocab_size) if tokenizer else None,
                   kv_cache=not args.no_kv_cache)
    seconds = time.perf_counter() - start
    new = len(out) - len(ids)
    print(tokenizer.decode(out) if tokenizer else " ".join(map(str, out)))
    print(f"generate: {new} tokens in {seconds:.2f} s ({new / max(seconds, 1e-9):.1f} tokens/s, "
          f"{'kv cache' if not args.no_kv_cache else 'no kv cache'}, {device.type} "
          f"{str(dtype).removeprefix('torch.')})", file=sys.stderr)
    return 0
