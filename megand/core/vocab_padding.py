"""How far the vocabulary is padded (Megatron's make-vocab-size-divisible-by). Plain integers, no torch:
the config schema, the models, the FLOPs count and the memory estimator all read it from here."""

# The default multiple: the vocabulary is padded to a multiple of this times tp, so that every rank's
# share of the logits GEMM (and of the embedding table) has an aligned width.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by`` x tp. The padding rows of the embedding
    and the output layer are never looked up, never predicted, and never saved."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
