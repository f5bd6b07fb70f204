"""What a path on disk is, in words for messages (:func:`file_kind`): shared by every check of an
input or output path (:mod:`harness.checks.consistency`, the readers of profile tables, engine files,
calibrations, workloads and replay files), with no dependency on the rest of the harness.
"""
from __future__ import annotations

import os
import stat


def file_kind(path: str | os.PathLike) -> str:
    """What ``path`` is, for messages: 'a file' (a regular one), 'a directory', 'a character device',
    'a block device', 'a named pipe', 'a socket', or 'missing'."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "neither a file nor a folder")
