"""The read-only HTTP server (swarm/observe/http.py): bad requests get an answer, never a crash,
and the server keeps serving good ones afterwards."""

from __future__ import annotations

import asyncio

import pytest

from swarm.observe.http import HttpConfig, HttpServer, Response

pytestmark = pytest.mark.timeout(60)


def _ok(query: str) -> Response:
    return Response(200, f"ok {query}".encode())


def _broken(query: str) -> Response:
    raise RuntimeError("a bug in a page")


ROUTES = {"/": _ok, "/broken": _broken}
LIMITS = HttpConfig(max_line=1024, max_headers=8, max_header_bytes=2048, read_timeout=1.0, write_timeout=2.0)


async def exchange(port: int, request: bytes, *, timeout: float = 10.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (b"GET /?a=1 HTTP/1.1\r\n\r\n", 200),
        (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
        (b"GET /" + b"?q=" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n", 400),  # a huge query string
        (b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 5000 + b"\r\n\r\n", 431),  # one huge header
        (b"GET / HTTP/1.1\r\n" + b"X-A: 1\r\n" * 20 + b"\r\n", 431),  # too many headers
        (b"GET / HTTP/1.1\r\n" + b"X-Mid: " + b"c" * 900 + b"\r\n" * 1 + b"X-Mid2: " + b"c" * 900 + b"\r\n"
         + b"X-Mid3: " + b"c" * 900 + b"\r\n\r\n", 431),  # headers too large together
        (b"POST / HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 300_000, 405),  # a body is never read
        (b"DELETE / HTTP/1.1\r\n\r\n", 405),
        (b"PUT /nowhere HTTP/1.1\r\n\r\n", 405),
        (b"GET\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 400),
        (b"GET nowhere HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET /\xff\xfe HTTP/1.1\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # a TLS hello
        (b"GET /broken HTTP/1.1\r\n\r\n", 500),
        (b"GET / HTTP/1.1\r\n", 400),  # cut short: the client half-closes before the blank line
    ],
)  # fmt: skip
async def test_every_request_gets_an_answer_and_the_server_stays_up(request_bytes: bytes, status: int) -> None:
    async with HttpServer(ROUTES, LIMITS) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert status_of(answer) == status, answer[:200]
        assert b"Content-Length:" in answer and b"Connection: close" in answer
        after = await exchange(server.port, b"GET /?again HTTP/1.1\r\n\r\n")
        assert status_of(after) == 200 and after.endswith(b"ok again")


async def test_head_has_no_body_and_405_says_what_is_allowed() -> None:
    async with HttpServer(ROUTES, LIMITS) as server:
        head = await exchange(server.port, b"HEAD / HTTP/1.1\r\n\r\n")
        assert status_of(head) == 200 and head.endswith(b"\r\n\r\n") and b"Content-Length: 3" in head
        post = await exchange(server.port, b"POST / HTTP/1.1\r\n\r\n")
        assert b"Allow: GET, HEAD" in post


async def test_a_silent_client_is_cut_off_by_the_read_timeout_and_others_are_served_meanwhile() -> None:
    async with HttpServer(ROUTES, LIMITS) as server:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HT")  # and nothing more
        started = loop.time()
        assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 200
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed without an answer
        assert loop.time() - started < 5
        writer.close()


async def test_clients_beyond_the_cap_get_503() -> None:
    config = HttpConfig(max_clients=2, read_timeout=3.0)
    async with HttpServer(ROUTES, config) as server:
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 503
        for _, writer in idle:
            writer.close()
        await asyncio.sleep(0.1)
        assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 200


def test_bad_settings_are_refused() -> None:
    for bad in ({"port": 70000}, {"max_line": 0}, {"read_timeout": 0}):
        with pytest.raises(ValueError):
            HttpConfig(**bad)
