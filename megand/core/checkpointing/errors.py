"""The checkpoint errors, in a module of their own so catching them does not import DCP."""

from __future__ import annotations

import errno


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message names the file or tensor."""


class CheckpointWriteError(RuntimeError):
    """A save that failed on some rank (disk full, file-size limit, quota, read-only directory); the
    previous checkpoint and ``latest`` are untouched. The message names the path and the OS error."""


# what a failed write usually means, in the user's words
_MEANING = {
    errno.EFBIG: "file too large (a file-size limit such as `ulimit -f`)",
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def _causes(exc: BaseException):
    """``exc``, the exceptions it wraps (DCP gathers every rank's failure) and their causes."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in failures.values())
        todo.extend([e.__cause__, e.__context__])


def describe_write_error(exc: BaseException) -> str:
    """One line for a failed write: the OS error and its meaning when one can be found."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno is not None:
            where = f" on {e.filename}" if e.filename else ""
            meaning = _MEANING.get(e.errno)
            return (f"{meaning}: " if meaning else "") + f"[Errno {e.errno}] {e.strerror}{where}"
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    # torch.save's zip writer reports a short write only as a position mismatch
    if "unexpected pos" in text or "file write failed" in text:
        return f"a write was cut short: file too large / disk full ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"
