"""Data pipeline: tokenizers, Megatron-format indexed datasets, GPT samples, blending.

Modules, one job each:
- ``tokenizer``: ``Tokenizer`` interface; sentencepiece, Hugging Face and tiktoken kinds (``load_tokenizer``), ``NullTokenizer``, ``build_tokenizer``.
- ``spm_train``: train a sentencepiece model (tools/train_tokenizer.py, quickstart).
- ``jsonl``: parse corpus lines, naming ``file:line`` for malformed ones.
- ``preprocess``: jsonl -> ``.bin``/``.idx`` with worker processes (tools/preprocess_data.py).
- ``indexed_dataset``: read, write and merge the Megatron-LM ``.bin``/``.idx`` format.
- ``gpt_dataset``: fixed-length samples across document boundaries (document/sample/shuffle indices).
- ``blended_dataset``: weighted mixture with Megatron's greedy assignment.
- ``index_cache``: the on-disk cache of those indices, keyed by a hash of their inputs.
- ``source``: ``DATA_KINDS``, one record per ``data.kind`` (its builder, random access or stream, its paths).
- ``builder``: ``build_datasets(data_cfg, ...)`` -> (train, valid, test), validating inputs first.
- ``stream``: JSON lines and Parquet read in order lane by lane, tokenized on the fly (``data.kind=stream``).
- ``hf_disk``: ``datasets`` ``save_to_disk`` directories, streamed (``data.kind=hf_disk``).
- ``quickstart``: an offline corpus from the standard library's pydoc topics.
- ``mock``: synthetic samples that need no files.
"""
