"""Wire protocol between parameter-server workers and servers.

Every message is a fixed header of :data:`HEADER_LEN` int64 values, sent with tag
:data:`TAG_HEADER`, optionally followed by a 1-D ``uint8`` payload of exactly
``header[NBYTES]`` bytes with tag :data:`TAG_PAYLOAD` -- a gradient or a parameter
shard packed by a compressor's ``to_wire``. Nothing else goes on the wire: no
pickled objects, no strings.

Header fields:

=========  =============================================================
MAGIC      :data:`MAGIC` (protocol version; anything else is rejected)
OP         one of the ``OP_*`` codes
CLOCK      worker -> server: the worker's clock after this push (0 for a
           pull); server -> worker: the worker's clock it answers
VERSION    worker -> server: the parameter version the gradient was
           computed on; server -> worker: the version sent
NBYTES     payload bytes (0: no payload follows)
LAG        server -> worker: the worker's clock lag at release
FLAGS      server -> worker: :data:`FLAG_STOP` when the gradient budget is spent
RESERVED   0
=========  =============================================================

Conversation of one worker with one server::

    worker                          server
    PULL(clock 0)          ->
                           <-       PARAMS(version v) + payload
    PUSH(clock c, read v)  + payload ->
                           <-       PARAMS(...) + payload      (when the policy releases it)
    ...
    FINISH(clock c)        ->
                           <-       BYE(final version) + payload   (once every worker is done)

A worker the server has dropped (declared lost, yet it speaks again) gets
``DROPPED`` (no payload) and stops alone, without stopping the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dtrain.comm.transport import Transport, Work
from dtrain.errors import CommError, CommTimeoutError

__all__ = [
    "HEADER_LEN",
    "PeerStalledError",
    "lost_error",
    "MAGIC",
    "OP_PULL",
    "OP_PUSH",
    "OP_FINISH",
    "OP_PARAMS",
    "OP_BYE",
    "OP_DROPPED",
    "OP_NAMES",
    "FLAG_STOP",
    "TAG_HEADER",
    "TAG_PAYLOAD",
    "Header",
    "ProtocolError",
    "PeerLostError",
    "RunAbortedError",
    "DroppedError",
    "send_message",
    "recv_header",
    "recv_payload",
    "brief",
]

HEADER_LEN = 8
MAGIC = 0x50530001  # "PS", protocol version 1

OP_PULL = 1
OP_PUSH = 2
OP_FINISH = 3
OP_PARAMS = 16
OP_BYE = 17
OP_DROPPED = 18
OP_NAMES = {
    OP_PULL: "pull",
    OP_PUSH: "push",
    OP_FINISH: "finish",
    OP_PARAMS: "params",
    OP_BYE: "bye",
    OP_DROPPED: "dropped",
}
WORKER_OPS = (OP_PULL, OP_PUSH, OP_FINISH)
SERVER_OPS = (OP_PARAMS, OP_BYE, OP_DROPPED)

FLAG_STOP = 1

TAG_HEADER = 7101
TAG_PAYLOAD = 7102

# header field positions
_MAGIC, _OP, _CLOCK, _VERSION, _NBYTES, _LAG, _FLAGS, _RESERVED = range(HEADER_LEN)


class ProtocolError(CommError):
    """A malformed or out-of-protocol message; it was not applied. Names the sender as ``peer``."""


class PeerLostError(CommError):
    """A worker or server process is gone (its connection closed or its heartbeat stopped)."""


class PeerStalledError(PeerLostError, CommTimeoutError):
    """A peer stopped answering without closing its connection (its heartbeat stopped: SIGSTOP, a hang).

    A timeout too: the process that raises it leaves its process groups alone as it ends (destroying
    them would wait on the silent peer; see ``dtrain.launch.agent``)."""


def lost_error(
    rank: int, op: str, cause: str, why: str, *, peer: int | None = None, step: int | None = None
) -> PeerLostError:
    """:class:`PeerStalledError` where the liveness monitor's ``why`` is a stopped heartbeat, else
    :class:`PeerLostError` (a closed connection)."""
    cls = PeerStalledError if why.startswith("no heartbeat") else PeerLostError
    return cls(rank, op, cause, peer=peer, step=step)


class RunAbortedError(CommError):
    """Another rank stopped the run; the message says which and why."""


class DroppedError(CommError):
    """This worker was declared lost (e.g. it stalled past the timeout) and the run went on without it."""


@dataclass(frozen=True)
class Header:
    """A decoded header (see the module docstring for the fields)."""

    op: int
    clock: int = 0
    version: int = 0
    nbytes: int = 0
    lag: int = 0
    flags: int = 0

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op, f"unknown op {self.op}")

    def encode(self) -> torch.Tensor:
        return torch.tensor(
            [MAGIC, self.op, self.clock, self.version, self.nbytes, self.lag, self.flags, 0], dtype=torch.int64
        )

    @classmethod
    def decode(cls, t: torch.Tensor, *, allowed: tuple[int, ...]) -> Header:
        """Read a received header; raise ``ValueError`` saying what is wrong."""
        v = [int(x) for x in t.tolist()]
        if v[_MAGIC] != MAGIC:
            raise ValueError(f"bad magic 0x{v[_MAGIC] & 0xFFFFFFFFFFFFFFFF:x} (not a dtrain parameter-server message)")
        if v[_OP] not in allowed:
            raise ValueError(f"unknown or unexpected op {v[_OP]}")
        if v[_NBYTES] < 0 or v[_CLOCK] < 0 or v[_VERSION] < 0:
            raise ValueError(f"negative field in header {v}")
        if v[_RESERVED] != 0:
            raise ValueError(f"reserved header field is {v[_RESERVED]}, expected 0")
        return cls(v[_OP], v[_CLOCK], v[_VERSION], v[_NBYTES], v[_LAG], v[_FLAGS])

    def __str__(self) -> str:
        return f"{self.op_name}(clock={self.clock}, version={self.version}, nbytes={self.nbytes})"


def send_message(transport: Transport, dst: int, header: Header, payload: torch.Tensor | None = None) -> list[Work]:
    """Start sending a header and (if ``header.nbytes``) its payload; returns the pending sends.

    The caller keeps ``payload`` alive until the returned works are waited.
    """
    if payload is not None and (payload.dtype != torch.uint8 or payload.dim() != 1):
        raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    n = 0 if payload is None else payload.numel()
    if n != header.nbytes:
        raise ValueError(f"header says {header.nbytes} payload bytes, payload has {n}")
    try:
        works = [transport.isend(header.encode(), dst, TAG_HEADER)]
        if payload is not None and n:
            works.append(transport.isend(payload, dst, TAG_PAYLOAD))
    except CommError:
        raise
    except RuntimeError as e:  # gloo refuses at once when the peer's connection is closed
        raise CommError(transport.rank, "send", brief(e), peer=dst) from None
    return works


def brief(e: BaseException) -> str:
    """The first sentence of a backend error, without gloo's source location."""
    text = str(getattr(e, "cause", None) or e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0][:200]


def recv_header(transport: Transport, src: int) -> torch.Tensor:
    """Block until the next header from ``src`` arrives (raw int64 tensor; decode it yourself)."""
    t = torch.empty(HEADER_LEN, dtype=torch.int64)
    _recv(transport, t, src, TAG_HEADER)
    return t


def _recv(transport: Transport, t: torch.Tensor, src: int, tag: int) -> None:
    try:
        transport.recv(t, src, tag)
    except CommError:
        raise
    except RuntimeError as e:  # gloo refuses at once when the peer's connection is closed
        raise CommError(transport.rank, "recv", brief(e), peer=src) from None


def recv_payload(transport: Transport, src: int, nbytes: int) -> torch.Tensor:
    """Receive the ``nbytes`` payload that follows a header from ``src``."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    _recv(transport, buf, src, TAG_PAYLOAD)
    return buf
