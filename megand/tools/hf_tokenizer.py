"""The run's tokenizer as Hugging Face files beside an exported model, so that
``transformers.AutoTokenizer.from_pretrained(out)`` encodes text into the ids megand's own tokenizer gives.

A sentencepiece ``.model`` becomes a ``tokenizer.json`` built by transformers' own converter from the model's
proto (its normalizer spec, dummy prefix, byte fallback and piece scores), loaded as a plain
``PreTrainedTokenizerFast``: transformers' ``LlamaTokenizer`` would rebuild the pipeline from the ``.model``
with its own settings and change leading spaces. A ``tokenizer.json`` is copied as it is. Either way no
BOS or EOS is added to encoded text (megand's data carries none but the end-of-document id) and special-token
strings inside a text are text, as megand encodes them (``split_special_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil

from megand.data.tokenizer import infer_tokenizer_type

WRITTEN = ("tokenizer.json", "tokenizer_config.json")


def write_hf_tokenizer(path: str, kind: str | None, out: str) -> str | None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the tokenizer file ``path`` into ``out``;
    the kind written, or None for a kind with no faithful Hugging Face form here (tiktoken)."""
    kind = kind or infer_tokenizer_type(path)
    special = {}
    if kind == "sentencepiece":
        from tokenizers.models import BPE, Unigram
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(path)
        spec = extractor.proto.trainer_spec
        model = BPE if spec.model_type == spec.BPE else Unigram
        vocab = extractor.extract(model)["vocab"]
        tokenizer = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, vocab, legacy=True)
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        for role, i, piece in (("bos_token", spec.bos_id, spec.bos_piece), ("eos_token", spec.eos_id, spec.eos_piece),
                               ("unk_token", spec.unk_id, spec.unk_piece)):
            if i >= 0:
                special[role] = piece
    elif kind == "huggingface":
        shutil.copyfile(path, os.path.join(out, "tokenizer.json"))
    else:
        return None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return kind
