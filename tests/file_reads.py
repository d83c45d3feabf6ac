"""Which files of a directory tree other processes open or read, seen from outside them with Linux inotify
(file contents only: listing a directory or stat-ing a file reads none). Running as root, permissions
cannot keep a process out of a file; inotify sees every open and read whoever makes it."""

import ctypes
import os
import struct

IN_ACCESS, IN_OPEN, IN_ISDIR, IN_Q_OVERFLOW = 0x1, 0x20, 0x40000000, 0x4000
IN_NONBLOCK = os.O_NONBLOCK
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded


class FileReads:
    """Watch the files under ``root`` that exist now; :meth:`files` names those opened or read since."""

    def __init__(self, root: str):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(IN_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs, self.existing = {}, set()
        for d, _, names in os.walk(root):
            wd = self.libc.inotify_add_watch(self.fd, d.encode(), IN_ACCESS | IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.dirs[wd] = d
            self.existing |= {os.path.join(d, n) for n in names}

    def files(self) -> set[str]:
        """The files that existed when the watch began and were opened or read since (closes the watch)."""
        seen, data = set(), b""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            data += chunk
        os.close(self.fd)
        at = 0
        while at < len(data):
            wd, mask, _, n = EVENT.unpack_from(data, at)
            name = data[at + EVENT.size:at + EVENT.size + n].rstrip(b"\0").decode()
            at += EVENT.size + n
            assert not mask & IN_Q_OVERFLOW, "inotify queue overflowed: events were lost"
            if not mask & IN_ISDIR and name:
                seen.add(os.path.join(self.dirs[wd], name))
        return seen & self.existing
