"""Convert between megand checkpoints (any parallel layout) and Hugging Face ``transformers`` directories.

    python tools/convert_checkpoint.py export --load ckpts/run --out hf/run [--dtype fp32] [--max-shard-size 5GB]
        megand checkpoint (a save dir with `latest`, or an iter_NNNNNNN dir) -> the one Hugging Face family
        that expresses every architecture key the model sets ({families}): safetensors shards
        (+ model.safetensors.index.json when there are several) and config.json, and the run's tokenizer
        (data.tokenizer, or --tokenizer) as tokenizer.json + tokenizer_config.json; a key no family expresses,
        or a tensor the family's rules do not cover, is refused before anything is written
    python tools/convert_checkpoint.py import --hf hf/run --save ckpts/imported [--dtype fp32]
        local transformers directory (safetensors) whose config.json's model_type is a family above (or a name
        a family reads as its own: kimi_k2 is deepseek_v3's architecture; it exports as deepseek_v3)
        -> megand checkpoint (model only, iteration 0), loadable at any layout with
        `checkpoint.load=ckpts/imported` (no model keys needed: the run takes the checkpoint's model);
        a config.json key the family does not read is refused
    python tools/convert_checkpoint.py upgrade-rng --load ckpts/run
        a checkpoint written by a megand whose RNG files were pickles of Python objects (which resume
        refuses to unpickle: a shared file could run code) -> RNG files of plain tensors, in place. Run it
        only on checkpoints you trust: it unpickles those files.

Both directions stream: one tensor is read, converted and written at a time (peak memory about the
largest tensor), shapes are checked from the config before any tensor is read,
and no model is built. Export writes bf16 unless --dtype says otherwise (a checkpoint holds fp32 weights);
import keeps the dtype of the files unless --dtype is given. An existing checkpoint
directory (import) or a non-empty output directory (export) is refused unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from megand.tools.hf_tokenizer import WRITTEN as TOKENIZER_FILES
from megand.tools.hf_tokenizer import write_hf_tokenizer
from megand.tools.progress import heartbeat

from megand.core.checkpointing import CheckpointError, files, offline
from megand.core.transformer.config import DTYPES
from megand.models import full
from megand.models.hf_families import LEFT_OUT, family_for_model, family_for_model_type, family_names, unread_keys
from megand.tools.safetensors_files import (
    FP8,
    INDEX,
    SafetensorsReader,
    ShardWriter,
    dequantize_blocks,
    parse_size,
)

DEFAULT_MAX_SHARD = "5GB"
# tensors that Hugging Face files may hold beside the weights (buffers of older transformers versions)
IGNORABLE = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _holds_checkpoints(path: str) -> bool:
    return os.path.isdir(path) and any(n == files.LATEST or n.startswith("iter_") for n in os.listdir(path))


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def run_tokenizer(load: str, run_cfg, given: str | None) -> tuple[str | None, str | None]:
    """``(path, kind)`` of the tokenizer to write beside the export: ``--tokenizer`` when given, else the
    run's ``data.tokenizer`` found from here (``(None, None)`` when the run set none)."""
    from megand.tools.generate import stored_tokenizer_path

    if given:
        if not os.path.isfile(given):
            raise ValueError(f"--tokenizer {given}: no such file")
        return given, None
    try:
        path = stored_tokenizer_path(load, run_cfg)
    except FileNotFoundError as e:
        raise ValueError(f"{e} (or --no-tokenizer to export the model alone)") from None
    return path, (run_cfg.get("data", {}) or {}).get("tokenizer_type") if path else None


def export(load: str, out: str, dtype: torch.dtype | None = torch.bfloat16, max_shard_bytes: int | None = None,
           force: bool = False, tokenizer: str | None = None, with_tokenizer: bool = True) -> None:
    max_shard_bytes = max_shard_bytes or parse_size(DEFAULT_MAX_SHARD)
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"--out {out}: directory is not empty (use --force to write into it)")
    run_cfg = full.read_config(load)
    tok_path, tok_kind = run_tokenizer(load, run_cfg, tokenizer) if with_tokenizer else (None, None)
    model_cfg = OmegaConf.to_container(run_cfg.model, resolve=True)
    adapter = family_for_model(model_cfg)
    rules = adapter.rules(model_cfg)
    stored = offline.tensor_shapes(load)
    expected = full.checkpoint_shapes(model_cfg)
    left_out = [o for o in LEFT_OUT if model_cfg.get(o.key) and o.key not in adapter.expresses]
    covered = {rule.megand for rule in rules}
    uncovered = sorted(n for n in stored if n not in covered and not any(n.startswith(o.prefix) for o in left_out))
    if uncovered:
        raise CheckpointError(f"{load}: tensor {uncovered[0]} ({len(uncovered)} in all) is not covered by the "
                              f"{adapter.model_type} adapter's rules: the export would compute another model")
    for rule in rules:
        if rule.megand not in stored:
            raise CheckpointError(f"{load}: tensor {rule.megand} is missing from the checkpoint")
        if stored[rule.megand][0] != expected[rule.megand]:
            raise CheckpointError(f"{load}: tensor {rule.megand} has shape {stored[rule.megand][0]}, the model "
                                  f"config gives {expected[rule.megand]}")
    if force and os.path.isdir(out):  # stale shards of an earlier export would mix with the new ones
        for name in os.listdir(out):
            if name in ("config.json", *TOKENIZER_FILES) or (name.startswith("model") and (name.endswith(".safetensors") or name == INDEX)):
                os.remove(os.path.join(out, name))

    entries = list({name: (name, shape, dtype or stored[rule.megand][1]) for rule in rules  # a packed tensor once
                    for name, shape in rule.hf_shapes(stored[rule.megand][0]).items()}.values())
    constants = adapter.constants(model_cfg) if adapter.constants else {}
    entries = [(name, tuple(t.shape), dtype or t.dtype) for name, t in constants.items()] + entries  # written first
    writer = ShardWriter(out, entries, max_shard_bytes)
    for name, tensor in constants.items():
        writer.add(name, _cast(tensor, dtype))
    blocks = {}  # a packed HF tensor's blocks until the last of its rules (Rule.block)
    for rule in tqdm(rules, desc="tensors", unit="tensor", disable=None):
        tensor = offline.load_tensors(load, [rule.megand])[rule.megand]
        for name, piece in zip(rule.hf, rule.to_hf(tensor)):
            if rule.block is None:
                writer.add(name, _cast(piece, dtype))
                continue
            dim, index, count = rule.block
            blocks.setdefault(name, {})[index] = piece
            if len(blocks[name]) == count:
                joined = blocks.pop(name)
                writer.add(name, _cast(torch.cat([joined[i] for i in range(count)], dim), dtype))

        del tensor
    shards = writer.close()
    config = adapter.hf_config(model_cfg)
    written = {d for _, _, d in entries}
    if len(written) == 1:
        config.dtype = written.pop()
    config.save_pretrained(out)
    written_kind = write_hf_tokenizer(tok_path, tok_kind, out) if tok_path else None
    n_params = sum(torch.Size(stored[r.megand][0]).numel() for r in rules)
    print(f"exported {load} ({adapter.model_type}, {n_params:,} parameters, {writer.total_bytes / 2**30:.2f} GiB "
          f"in {len([s for s in shards if s != INDEX])} safetensors file(s)) to {out}")
    if written_kind:
        print(f"tokenizer: {tok_path} ({written_kind}) -> {os.path.join(out, TOKENIZER_FILES[0])}")
    elif tok_path:
        print(f"not exported: the tokenizer {tok_path} (a tiktoken file has no faithful tokenizer.json here)")
    for o in left_out:
        print(f"not exported: the {model_cfg[o.key]} {o.what} ({o.prefix}*, model.{o.key}): {adapter.model_type} "
              f"has no such module; the main model's next-token predictions are complete without them")


def read_hf_config(hf_dir: str):
    """The transformers config of a local directory (never a download) and its family; ValueError naming a
    key of its config.json that the family does not read."""
    from transformers import AutoConfig

    if not os.path.isdir(hf_dir):
        raise ValueError(f"--hf {hf_dir}: no such local directory (models are not downloaded)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--hf {hf_dir}: no config.json (not a transformers model directory)")
    with open(path) as f:
        raw = json.load(f)
    family = family_for_model_type(raw.get("model_type"))
    if raw.get("model_type") in family.aliases:  # the family's config under another name (transformers has no class
        # of that name, the file's own code is not run): built by the family's config class
        config = AutoConfig.for_model(family.model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    else:
        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    unread = unread_keys(family, raw, type(config).attribute_map)
    if unread:
        raise ValueError(f"--hf {hf_dir}: config.json key(s) {', '.join(unread)}: the {family.model_type} adapter "
                         f"does not read them (megand cannot tell that the model keeps its meaning)")
    return config, family


def fp8_blocks(config) -> tuple[int, int] | None:
    """The weight block of a config's block-scaled FP8 weights (DeepSeek-V3's published files:
    ``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size``), None without quantization;
    ValueError for another quantization."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8" or len(q.get("weight_block_size") or ()) != 2:
        raise ValueError(f"quantization_config quant_method={q.get('quant_method')!r} "
                         f"weight_block_size={q.get('weight_block_size')}: only block-scaled fp8 weights "
                         f"(DeepSeek-V3's) are read, dequantized on import")
    return tuple(q["weight_block_size"])


def import_(hf_dir: str, save: str, dtype: torch.dtype | None = None, force: bool = False) -> None:
    if _holds_checkpoints(save) and not force:
        raise ValueError(f"--save {save}: already holds checkpoints (use --force to replace `latest` with the import)")
    config, adapter = read_hf_config(hf_dir)
    block = fp8_blocks(config)
    model_cfg = adapter.model_config(config)
    try:
        reader = SafetensorsReader(hf_dir)
    except FileNotFoundError as e:
        raise ValueError(f"--hf {hf_dir}: {e}") from None
    present = set(reader.names())
    marker = adapter.mtp_marker
    if model_cfg.get("mtp_layers") and marker is not None and marker(model_cfg) not in present:
        # e.g. a model saved by transformers, whose class drops DeepSeek's MTP module but keeps the config key
        print(f"note: config.json gives {model_cfg['mtp_layers']} multi-token prediction module(s) but the files "
              f"hold none ({marker(model_cfg)} is absent): imported without them (model.mtp_layers=0)")
        model_cfg = dict(model_cfg, mtp_layers=0)

    def source_name(name: str) -> str:  # base-model files (e.g. the original gpt2) lack the head's prefix
        if name in present:
            return name
        short = name.split(".", 1)[1]
        if short in present:
            return short
        raise CheckpointError(f"--hf {hf_dir}: tensor {name} is missing")

    rules = adapter.rules(model_cfg)
    expected = full.checkpoint_shapes(model_cfg)
    shapes, used = {}, set()
    for rule in rules:
        for name, shape in rule.hf_shapes(expected[rule.megand]).items():
            src = source_name(name)
            used.add(src)
            if reader.shape(src) != shape:
                raise CheckpointError(f"--hf {hf_dir}: tensor {src} has shape {reader.shape(src)}, "
                                      f"config.json gives {shape}")
            if reader.dtype(src) == FP8:
                if block is None or src + "_scale_inv" not in present:
                    raise CheckpointError(f"--hf {hf_dir}: tensor {src} is fp8 without a block-scaled "
                                          f"quantization_config and its {src}_scale_inv")
                used.add(src + "_scale_inv")
        first = source_name(rule.hf[0])
        # dequantized FP8 weights are kept in bf16 (as DeepSeek's own conversion writes them) unless --dtype
        shapes[rule.megand] = (expected[rule.megand], dtype or (torch.bfloat16 if reader.dtype(first) == FP8
                                                                  else reader.dtype(first)))
    for name, value in (adapter.constants(model_cfg) if adapter.constants else {}).items():
        held = reader.get(source_name(name))
        if held.shape != value.shape or not torch.equal(held.to(value.dtype), value):
            raise CheckpointError(f"--hf {hf_dir}: tensor {name} holds {held.flatten()[:4].tolist()}: megand's "
                                  f"{adapter.model_type} model computes with {value.flatten()[:4].tolist()} there")
        used.add(source_name(name))
    ignored = sorted(n for n in present - used
                     if not (n.endswith(IGNORABLE) or (model_cfg["tie_embeddings"] and n == "lm_head.weight")))
    if ignored:
        raise CheckpointError(f"--hf {hf_dir}: {len(ignored)} tensor(s) that a {adapter.model_type} model of this "
                              f"config does not have, e.g. {ignored[0]}")

    by_megand = {rule.megand: rule for rule in rules}
    progress = tqdm(total=len(rules), desc="tensors", unit="tensor", disable=None)

    def read(name: str) -> torch.Tensor:
        tensor = reader.get(name)
        return dequantize_blocks(tensor, reader.get(name + "_scale_inv"), block) if tensor.dtype == FP8 else tensor

    packed = {}  # a packed HF tensor, read once, with the blocks its rules have yet to cut (Rule.block)

    def read_for(rule, name: str) -> torch.Tensor:
        if rule.block is None:
            return read(source_name(name))
        if name not in packed:
            packed[name] = [read(source_name(name)), rule.block[2]]
        entry = packed[name]
        entry[1] -= 1
        if not entry[1]:
            del packed[name]
        return rule.cut(entry[0])

    def produce(name: str) -> torch.Tensor:
        rule = by_megand[name]
        tensor = rule.from_hf(*(read_for(rule, n) for n in rule.hf))
        progress.update()
        return _cast(tensor, shapes[name][1])


    config_yaml = OmegaConf.to_yaml({"model": model_cfg})
    try:
        path = offline.save_model_streaming(save, shapes, produce, config_yaml, model_cfg)
    finally:
        progress.close()
    print(f"imported {hf_dir} ({config.model_type}, "
          f"{sum(torch.Size(s).numel() for s, _ in shapes.values()):,} parameters) to {path}")


def upgrade_rng(load: str) -> None:
    """Rewrite the format-1 RNG files of the checkpoint ``load`` (trusted by whoever runs this) as plain
    tensors, and their checksums in the manifest."""
    from megand.core.checkpointing import rng
    from megand.core.checkpointing.checkpointer import write_torch

    iter_dir = files.resolve(load)
    rng_dir = os.path.join(iter_dir, "rng")
    names = sorted(n for n in os.listdir(rng_dir) if n.endswith(".pt")) if os.path.isdir(rng_dir) else []
    manifest_path = os.path.join(iter_dir, files.MANIFEST)
    manifest = json.load(open(manifest_path)) if os.path.isfile(manifest_path) else None
    upgraded = 0
    for name in names:
        path = os.path.join(rng_dir, name)
        try:
            rng.read(path)
            continue  # already plain tensors
        except CheckpointError:
            pass
        old = torch.load(path, weights_only=False)  # the user vouches for this checkpoint
        tmp = f"{path}.tmp{os.getpid()}"
        write_torch(rng.from_format1(old), tmp)
        os.replace(tmp, path)
        if manifest is not None and os.path.join("rng", name) in manifest["crc32"]:
            manifest["crc32"][os.path.join("rng", name)] = files.file_crc(path)
        upgraded += 1
    if manifest is not None and upgraded:
        files.atomic_write_text(manifest_path, json.dumps(manifest))
    print(f"upgraded {upgraded} of {len(names)} RNG files in {rng_dir}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.format(families=family_names()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="megand checkpoint -> Hugging Face directory")
    e.add_argument("--load", required=True, help="megand save dir (with `latest`) or iteration dir")
    e.add_argument("--out", required=True, help="output transformers directory (new or empty)")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the written tensors (default bf16, as models are published; fp32 keeps the "
                        "checkpoint's fp32 weights exactly)")
    e.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD,
                   help=f"largest safetensors file, e.g. 500MB, 5GB (default {DEFAULT_MAX_SHARD})")
    e.add_argument("--force", action="store_true", help="write into a non-empty --out")
    e.add_argument("--tokenizer", help="tokenizer file to write beside the model as tokenizer.json (default: the "
                                       "run's data.tokenizer, when it set one)")
    e.add_argument("--no-tokenizer", action="store_true", help="export the model without tokenizer files")
    i = sub.add_parser("import", help="Hugging Face directory -> megand checkpoint")
    i.add_argument("--hf", required=True, help=f"local transformers directory ({family_names()}; safetensors)")
    i.add_argument("--save", required=True, help="megand save dir to create (iter_0000000 + latest)")
    i.add_argument("--dtype", choices=sorted(DTYPES),
                   help="dtype of the checkpoint's tensors (default: the dtype of each tensor in the files)")
    i.add_argument("--force", action="store_true", help="import into a directory that already holds checkpoints")
    u = sub.add_parser("upgrade-rng", help="rewrite an older megand checkpoint's RNG files as plain tensors (in place)")
    u.add_argument("--load", required=True, help="megand save dir (with `latest`) or iteration dir, from a source you trust")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype] if getattr(args, "dtype", None) else None  # None: keep each tensor's dtype
    try:
        with heartbeat(f"convert_checkpoint {args.command}"):  # a line every few seconds in logs (no tty bar)
            if args.command == "export":
                export(args.load, args.out, dtype, parse_size(args.max_shard_size), args.force, args.tokenizer,
                       not args.no_tokenizer)
            elif args.command == "upgrade-rng":
                upgrade_rng(args.load)
            else:
                import_(args.hf, args.save, dtype, args.force)
    except (CheckpointError, ValueError) as err:
        print(f"convert_checkpoint: {err}", file=sys.stderr)
        return 2
    return 0
