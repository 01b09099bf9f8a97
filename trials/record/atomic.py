"""Atomic files: written to a temporary name beside the target, fsynced, renamed into place.

A reader never sees half a file, and a crash or a full disk leaves at most a dot-prefixed
``.tmp`` file (removed here when the write fails, and by the store's clean-up otherwise). Every
local file JuicyTalk writes for a user (records, reports, tables, ``--json``) goes through here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable


def temporary_name(final: str) -> str:
    """``dir/.name.<random>.tmp`` beside ``final``: ignored by every reader of the directory."""
    directory, _, name = str(final).rpartition("/")
    return f"{directory}/.{name}.{uuid.uuid4().hex[:8]}.tmp" if directory else f".{name}.{uuid.uuid4().hex[:8]}.tmp"


def write_atomic(final: str | Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` then fsync, rename onto ``final`` and fsync the directory."""
    final = str(Path(final).resolve())
    tmp = temporary_name(final)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_text_atomic(final: str | Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    write_atomic(final, write)
