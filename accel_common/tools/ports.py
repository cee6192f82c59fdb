"""A free TCP port on the loopback address, for launches that must not collide."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]
