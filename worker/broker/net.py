"""Loopback networking for the local broker: free ports, and a Kafka-protocol readiness probe."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct


def free_ports(num_ports: int, host: str = "127.0.0.1") -> list[int]:
    """`num_ports` distinct ports free right now; all sockets stay open until every port is picked."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(num_ports)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server socket could listen on host:port now, as the broker's JVM would bind it.

    The JVM sets SO_REUSEADDR on its server sockets (everywhere but Windows), so TIME_WAIT connections left
    by a broker that just stopped do not block its restart; a probe without the option would call the port
    taken for about a minute after `broker stop`. A socket listening on the port still makes it busy.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if os.name == "posix":  # on Windows SO_REUSEADDR lets a bind steal a port in use: not what we ask
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def probe_api_versions(host: str, port: int, timeout_s: float = 2.0, ssl_context: ssl.SSLContext | None = None) -> bool:
    """True when something on host:port answers a Kafka ApiVersions request without error (over TLS with
    `ssl_context`; a SASL listener answers ApiVersions before authentication).

    A bare TCP connect is not enough: the socket accepts before the broker serves requests.
    """
    correlation_id = 0x4B4C4C4D
    client_id = b"llm-worker-probe"
    # Request header v1 (api_key 18 = ApiVersions, version 0, correlation id, client id); v0 has no body.
    payload = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout_s))
            if ssl_context is not None:
                sock = stack.enter_context(ssl_context.wrap_socket(sock, server_hostname=host))
            sock.sendall(struct.pack(">i", len(payload)) + payload)
            header = _recv_exact(sock, 10)  # size, correlation id, error code
    except OSError:
        return False
    _, got_correlation_id, error_code = struct.unpack(">iih", header)
    return got_correlation_id == correlation_id and error_code == 0


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks = b""
    while len(chunks) < num_bytes:
        chunk = sock.recv(num_bytes - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks += chunk
    return chunks
