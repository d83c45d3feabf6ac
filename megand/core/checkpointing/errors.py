"""The checkpoint errors, in a module of their own so catching them does not import DCP."""

from __future__ import annotations

import errno
import os
import resource


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


def _short_write_cause(directory: str | None) -> str:
    """Why a write was cut short when the writer did not keep the OS error: the file-size limit of this
    process, or the free space left where it wrote."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"file too large: the file-size limit of this process is {soft} bytes (ulimit -f)"
    if directory:
        try:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            if free < 64 << 20:
                return f"disk full: {free} bytes free on {directory}"
        except OSError:
            pass
    return "file too large / disk full"


def describe_write_error(exc: BaseException, directory: str | None = None) -> str:
    """One line for a failed write into ``directory``: the OS error and its meaning when one can be found."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno is not None:
            where = f" on {e.filename}" if e.filename else ""
            meaning = _MEANING.get(e.errno)
            return (f"{meaning}: " if meaning else "") + f"[Errno {e.errno}] {e.strerror}{where}"
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    # torch.save's zip writer reports a short write only as a position mismatch
    if "unexpected pos" in text or "file write failed" in text:
        return f"{_short_write_cause(directory)} (a write was cut short: {text})"
    return f"{type(exc).__name__}: {text}"
