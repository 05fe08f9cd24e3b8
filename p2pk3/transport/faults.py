"""Fault injection for tests: what a `Faults` does to the frames one side of a connection sends after the
handshake (delay, abort, black hole, one corrupted byte). Sans-IO: no sockets, no event loop. The
connection's one send path (`Connection._send_frame` in p2pk3.transport.connection) asks these questions
about every frame it encodes, so a faulty connection runs exactly the production code around the fault:
the same encoding, the same writev / transport hand-off, the same close and error paths.

`PROCESS` applies to every connection whose own Faults are off: `cut_off_on_signals()` (a node started
with the hidden `--fault-signals`, tools/chaos.py) makes SIGUSR1 black-hole every frame the process sends
on any connection, old or new, and SIGUSR2 end that: the node cannot answer nor send (a partition of that
node on loopback, where network namespaces are not at hand), while it still hears what reaches it."""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from typing import Any


@dataclass
class Faults:
    """Fault injection for tests, applied to frames this side SENDS after the handshake (off by default).

    delay_s        added before every frame is written (plus uniform jitter in [0, jitter_s])
    close_after    after this many frames the connection is aborted (a crashed peer)
    drop_after     frames after this many are silently discarded (a black hole; the connection stays up)
    corrupt_frame  0-based index of the frame in which one byte is XORed with corrupt_xor
    corrupt_offset offset of that byte in the encoded frame (0..3: magic, 4: version, 18+: header, ...)
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    close_after: int | None = None
    drop_after: int | None = None
    corrupt_frame: int | None = None
    corrupt_offset: int = 0
    corrupt_xor: int = 0xFF

    @property
    def active(self) -> bool:
        return bool(
            self.delay_s
            or self.jitter_s
            or self.close_after is not None
            or self.drop_after is not None
            or self.corrupt_frame is not None
        )

    def closes_at(self, sent: int) -> bool:
        """Whether the connection is to be aborted once `sent` frames have been sent."""
        return self.close_after is not None and sent >= self.close_after

    @property
    def close_reason(self) -> str:
        return f"fault injection: closed after {self.close_after} frames"

    def delay(self) -> float | None:
        """Seconds to wait before writing the next frame (a fresh jitter each call); None: no delay."""
        if not (self.delay_s or self.jitter_s):
            return None
        return self.delay_s + random.uniform(0, self.jitter_s)

    def drops(self, index: int) -> bool:
        """Whether frame `index` (0-based, counting frames sent after the handshake) is discarded."""
        return self.drop_after is not None and index >= self.drop_after

    def corrupt(self, index: int, chunks: list[Any]) -> list[Any]:
        """The encoded chunks of frame `index`, with the configured byte flipped if it is the one to corrupt
        (then joined into one chunk; an offset past the frame's end changes nothing)."""
        if self.corrupt_frame != index:
            return chunks
        data = bytearray(b"".join(bytes(c) for c in chunks))
        if self.corrupt_offset < len(data):
            data[self.corrupt_offset] ^= self.corrupt_xor
        return [bytes(data)]


PROCESS = Faults()  # applies to every connection whose own faults are off (off unless set)


def cut_off_on_signals() -> None:
    """SIGUSR1: every frame this process sends from now on is discarded; SIGUSR2: sending works again."""

    def cut(signum, frame) -> None:
        PROCESS.drop_after = 0 if signum == signal.SIGUSR1 else None

    signal.signal(signal.SIGUSR1, cut)
    signal.signal(signal.SIGUSR2, cut)


__all__ = ["Faults", "PROCESS", "cut_off_on_signals"]
