"""The front door's transport bounds (server/transport.py) under both of uvicorn's HTTP parsers:
a request head gets `head_timeout` seconds (an idle connection, a slowloris head, the next request
on a kept-alive connection), connections past `max_connections` are closed as they open, and a
normal request is untouched. A real uvicorn server on loopback with a minimal ASGI app."""
from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest
import uvicorn

from tokenmill.server.transport import HttpToolsProtocol, add_arguments, bounded_http, front_door

PARSERS = ["h11", "httptools"]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=PARSERS)
def door(request):
    if request.param == "httptools" and HttpToolsProtocol is None:
        pytest.skip("httptools is not installed")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    http = bounded_http(head_timeout=1.0, max_connections=4, parser=request.param)
    server = uvicorn.Server(uvicorn.Config(app, http=http, loop="asyncio", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed_after(sock: socket.socket, seconds: float) -> tuple[float | None, bytes]:
    """Seconds until the server closes the connection (None: still open after `seconds`), and what it sent."""
    sock.settimeout(seconds)
    t0, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return None, got
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, got


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def answered(sock: socket.socket) -> bool:
    """Reads one response (the app's is 2 bytes long); whether it is the app's 200."""
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(1024)
        if not chunk:
            return False
        got += chunk
    return got.startswith(b"HTTP/1.1 200")


def test_heads_get_a_deadline(door):
    idle, slow, kept = connect(door), connect(door), connect(door)
    slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # half a head, then nothing
    kept.sendall(GET)
    assert answered(kept)
    kept.sendall(b"GET / HTTP/1.1\r\n")  # the next request on the kept-alive connection stalls too
    for sock in (idle, slow, kept):
        took, got = closed_after(sock, 5)
        assert took is not None and took < 3 and got == b""


def test_a_timely_client_keeps_its_connection(door):
    sock = connect(door)
    for _ in range(3):  # three requests over 1.8 s, each head whole: the 1 s deadline is per head
        sock.sendall(GET)
        assert answered(sock)
        time.sleep(0.6)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)
    sock.sendall(b"\r\n")  # the head completed inside its second
    assert answered(sock)


def test_connections_past_the_cap_are_closed(door):
    held = [connect(door) for _ in range(4)]
    time.sleep(0.1)
    extra = connect(door)
    took, got = closed_after(extra, 0.5)
    assert took is not None and got == b""
    for sock in held:
        sock.close()
    time.sleep(0.1)
    sock = connect(door)
    sock.sendall(GET)
    assert answered(sock)


def test_flags_and_bad_values():
    p = argparse.ArgumentParser()
    add_arguments(p, float)
    opts = front_door(p.parse_args(["--http-parser", "h11", "--event-loop", "asyncio"]))
    assert opts["loop"] == "asyncio" and opts["http"].__mro__[2].__name__ == "H11Protocol"
    auto = front_door(p.parse_args([]))["http"]
    assert auto.__mro__[2].__name__ == ("H11Protocol" if HttpToolsProtocol is None else "HttpToolsProtocol")
    with pytest.raises(SystemExit):
        p.parse_args(["--http-parser", "picohttp"])
    with pytest.raises(ValueError, match="positive"):
        bounded_http(0, 4)
    with pytest.raises(ValueError, match="at least 1"):
        bounded_http(1, 0)
