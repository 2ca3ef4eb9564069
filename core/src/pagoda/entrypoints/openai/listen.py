"""The server's listening socket, made before anything heavy is imported or loaded."""

from __future__ import annotations

import socket
from pathlib import Path

# uvicorn's default backlog: connections made while the model loads wait in it (answered once ready)
BACKLOG = 2048


def bind_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """Bind and listen first, so a busy address fails in a fraction of a second, not after the model loads;
    ``uds``: a Unix domain socket at that path instead (vLLM's --uds), replacing a stale socket file.

    Listening, not only binding, is what makes a second server fail: on Linux two sockets with
    SO_REUSEADDR may both bind one port as long as neither listens, so two servers started at once both
    loaded the model before one failed in uvicorn's listen(). Nothing accepts until the engine is ready:
    /health is first answered (200) then, as vLLM's.
    """
    if uds is not None:
        path = Path(uds)
        if path.is_socket():
            path.unlink()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(uds)
        unix.listen(BACKLOG)
        unix.set_inheritable(True)
        return unix
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # a restarted server may take the port over from connections of the last one in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
