"""The log line of a training run: printed and appended to the run's train.log."""

from __future__ import annotations


def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()
