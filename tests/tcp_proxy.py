"""A small threaded TCP proxy on loopback, to take a server "down" and bring it back on the same port.

Tests put it in front of the moto S3 server: ``down()`` makes every new connection fail with ECONNREFUSED and
resets (RST) every open one, as when an S3 endpoint or the network path to it goes away; ``up()`` listens again
on the same port. ``resetting()`` keeps listening but resets each connection as soon as it is accepted, or
(``on_request=True``) once the client has sent its first bytes: a server that drops connections, before or in the
middle of a request.

The port is taken below the kernel's ephemeral range, so that while the proxy is down no outgoing connection can
be given that port and ``up()`` rebinds it.
"""

from __future__ import annotations

import contextlib
import random
import selectors
import socket
import struct
import threading
import time

_POLL_S = 0.05  # how often the accept loop and the pumps look at their stop flags


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.settimeout(_POLL_S)
    return sock


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST (SO_LINGER 0), not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Connection:
    """One proxied connection: a thread pumping bytes both ways until either side closes or ``kill()``."""

    def __init__(
        self, client: socket.socket, upstream: socket.socket, on_exit, *, reset_on_request: bool = False
    ) -> None:  # noqa: ANN001
        self.client, self.upstream, self._on_exit = client, upstream, on_exit
        self.reset_on_request = reset_on_request
        self._killed = threading.Event()
        self.thread = threading.Thread(target=self._pump, name="tcp-proxy-conn", daemon=True)

    def kill(self) -> None:
        self._killed.set()

    def _pump(self) -> None:
        peers = {self.client: self.upstream, self.upstream: self.client}
        sel = selectors.DefaultSelector()
        try:
            for s in peers:
                s.settimeout(5.0)  # a send never blocks for good
                sel.register(s, selectors.EVENT_READ)
            while not self._killed.is_set():
                for key, _ in sel.select(_POLL_S):
                    src = key.fileobj
                    try:
                        data = src.recv(1 << 16)
                        if not data:  # one side closed: close both (HTTP needs no half-close here)
                            return
                        if self.reset_on_request and src is self.client:  # the request is in flight: drop it
                            self._killed.set()
                            break
                        peers[src].sendall(data)
                    except OSError:
                        self._killed.set()
                        break
        finally:
            sel.close()
            if self._killed.is_set():
                _reset(self.client)
                _reset(self.upstream)
            else:
                for s in peers:
                    with contextlib.suppress(OSError):
                        s.close()
            self._on_exit(self)


class TcpProxy:
    """Forward ``host:port`` (a free port picked at start, kept across ``down()``/``up()``) to ``target``.

    Args:
        target: ``(host, port)`` of the server behind the proxy.
        host: where the proxy listens.
        seed: picks the port (a free one below the ephemeral range).
    """

    def __init__(self, target: tuple[str, int], *, host: str = "127.0.0.1", seed: int = 0) -> None:
        self.target, self.host = target, host
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stop = threading.Event()
        self._reset_mode = ""  # "", "accept" or "request"
        self.port = self._pick_port(seed)

    def _pick_port(self, seed: int) -> int:
        lo, _ = _ephemeral_range()
        rng = random.Random(seed)
        for _ in range(200):
            port = rng.randrange(max(1024, lo - 12000), lo)
            try:
                self._start(_listen(self.host, port))
                return port
            except OSError:
                continue
        msg = f"no free port below the ephemeral range ({lo}) on {self.host}"
        raise RuntimeError(msg)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---------------------------------------------------------------- state
    def up(self) -> None:
        """Listen again on the same port and forward new connections (no-op if up)."""
        with self._lock:
            self._reset_mode = ""
            if self._listener is not None:
                return
        deadline = time.monotonic() + 10
        while True:
            try:
                sock = _listen(self.host, self.port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._start(sock)

    def down(self) -> None:
        """Stop listening (connects are refused) and reset every open connection; returns once both are done."""
        self._stop_listening()
        self._kill_all()

    def resetting(self, *, on_request: bool = False) -> None:
        """Listen, but reset each new connection as soon as it is accepted or, with ``on_request``, once its
        client has sent the first bytes of a request; open connections are reset at once."""
        self.up()
        with self._lock:
            self._reset_mode = "request" if on_request else "accept"
        self._kill_all()

    def close(self) -> None:
        self.down()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # ---------------------------------------------------------------- internals
    def _start(self, sock: socket.socket) -> None:
        self._stop = threading.Event()
        self._listener = sock
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(sock, self._stop), name="tcp-proxy-accept", daemon=True
        )
        self._acceptor.start()

    def _stop_listening(self) -> None:
        with self._lock:
            sock, acceptor, stop = self._listener, self._acceptor, self._stop
            self._listener = self._acceptor = None
        if sock is None:
            return
        stop.set()
        acceptor.join()  # the accept loop closes the socket itself (a close from here would not wake accept())

    def _kill_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.kill()
        for c in conns:
            c.thread.join(timeout=10)

    def _accept_loop(self, sock: socket.socket, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    client, _ = sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if stop.is_set():
                        return
                    raise
                with self._lock:
                    mode = self._reset_mode
                if mode == "accept":
                    _reset(client)
                    continue
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    _reset(client)
                    continue
                conn = _Connection(client, upstream, self._forget, reset_on_request=mode == "request")
                with self._lock:
                    self._conns.add(conn)
                conn.thread.start()
        finally:
            sock.close()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
