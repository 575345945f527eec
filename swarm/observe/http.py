"""HttpServer: the smallest HTTP/1.1 server that serves read-only pages from an asyncio loop.

    routes = {"/metrics": lambda query: Response(200, text, CONTENT_TYPE)}
    async with HttpServer(routes, HttpConfig(host="127.0.0.1", port=9100)) as server:
        print(server.url)

One request per connection (`Connection: close`), GET and HEAD only, no request bodies. A route
is a plain function of the query string that returns at once (it reads what a poller keeps
ready: it never waits on the network). Everything is bounded, so a bad client costs little and
never crashes the node:

    request line longer than max_line             -> 400 (a huge query string)
    more than max_headers, or max_header_bytes    -> 431
    a malformed request line or header            -> 400
    a method other than GET or HEAD               -> 405 (Allow: GET, HEAD); a body is never read
    a path no route serves                        -> 404
    a route that raises                           -> 500 (logged)
    more than max_clients connections at once     -> 503
    a client that sends its request slowly        -> closed after read_timeout
    a client that does not read the response      -> closed after write_timeout
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}  # fmt: skip
# pages are self-contained: inline script and style, data from this origin only, nothing else
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Route = Callable[[str], Response]  # the query string (without "?") -> the response


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"  # loopback: read-only pages are still nobody else's business
    port: int = 0  # 0: any free port (see HttpServer.port)
    max_line: int = 8 << 10  # the request line, query string included
    max_headers: int = 64
    max_header_bytes: int = 16 << 10  # all header lines together
    max_clients: int = 32  # connections served at once
    read_timeout: float = 10.0  # to receive the request line and headers
    write_timeout: float = 10.0  # to hand the response over to a slow reader
    drain_bytes: int = 1 << 20  # after an error, what the client still sends is read and dropped, at most
    drain_timeout: float = 1.0  # ... for this long (closing on unread bytes would reset the connection
    # before the client reads the answer)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if min(self.max_line, self.max_headers, self.max_header_bytes, self.max_clients) < 1:
            raise ValueError("HTTP limits must be >= 1")
        if min(self.read_timeout, self.write_timeout) <= 0:
            raise ValueError("HTTP timeouts must be > 0")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServer:
    """Serves `routes` on config.host:config.port from the running event loop."""

    def __init__(self, routes: Mapping[str, Route], config: HttpConfig | None = None) -> None:
        self.routes = dict(routes)
        self.config = config or HttpConfig()
        self._server: asyncio.Server | None = None
        self._clients = 0

    async def start(self) -> HttpServer:
        if self._server is None:
            # the reader's limit bounds one line: a longer one raises instead of buffering on
            self._server = await asyncio.start_server(self._serve, self.config.host, self.config.port,
                                                      limit=self.config.max_line + 2)  # fmt: skip
        return self

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = self.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/"

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):  # a stuck client is cut off by its own timeouts
                await asyncio.wait_for(server.wait_closed(), self.config.write_timeout)

    async def __aenter__(self) -> HttpServer:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # --- one connection ---------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients += 1
        try:
            if self._clients > self.config.max_clients:  # answered at once and closed: nothing is read
                await asyncio.wait_for(_write(writer, _error(503, "too many clients"), False), 1.0)
                return
            response, head_only = await self._respond(reader)
            await asyncio.wait_for(_write(writer, response, head_only), self.config.write_timeout)
            if response.status >= 400:
                await self._drain(reader, writer)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or stalled: nothing to answer
        finally:
            self._clients -= 1
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), self.config.write_timeout)

    async def _drain(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read and drop what the client still sends (bounded in bytes and time)."""
        if writer.can_write_eof():
            writer.write_eof()
        left = self.config.drain_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while left > 0:
            chunk = await asyncio.wait_for(reader.read(min(left, 64 << 10)), max(0.0, deadline - loop.time()))
            if not chunk:
                return
            left -= len(chunk)

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[Response, bool]:
        try:
            method, target = await asyncio.wait_for(self._read_request(reader), self.config.read_timeout)
        except BadRequest as e:
            return _error(e.status, str(e)), False
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return _error(405, f"{method} is not served: this server is read-only", (("Allow", "GET, HEAD"),)), False
        parts = urlsplit(target)
        route = self.routes.get(parts.path)
        if route is None:
            return _error(404, f"no page at {parts.path[:200]}"), head_only
        try:
            return route(parts.query), head_only
        except Exception:
            logger.exception("HTTP route %s failed", parts.path)
            return _error(500, "the page failed; the server's log says why"), head_only

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        """(method, target) of the request; its headers are read (bounded) and dropped."""
        line = await _line(reader, 400, "request line too long", first=True)
        words = line.split(" ")
        if len(words) != 3 or not words[0].isalpha() or not words[2].startswith("HTTP/1."):
            raise BadRequest(400, "malformed request line")
        method, target = words[0].upper(), words[1]
        if not target.startswith("/") or not target.isprintable():
            raise BadRequest(400, "malformed request target")
        total = 0
        for _ in range(self.config.max_headers + 1):
            header = await _line(reader, 431, "header line too long")
            if not header:
                return method, target
            total += len(header)
            if total > self.config.max_header_bytes:
                raise BadRequest(431, "headers too large")
            if ":" not in header:
                raise BadRequest(400, "malformed header")
        raise BadRequest(431, "too many headers")


async def _line(reader: asyncio.StreamReader, status: int, too_long: str, *, first: bool = False) -> str:
    """One line; a client that closes before sending anything gets no answer (IncompleteReadError)."""
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise BadRequest(status, too_long) from None
    except asyncio.IncompleteReadError as e:
        if first and not e.partial:
            raise
        raise BadRequest(400, "request cut short") from None
    try:
        return raw.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError:
        raise BadRequest(400, "request is not ASCII") from None


def _error(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, f"{status} {REASONS.get(status, '')}: {message}\n".encode(), headers=headers)


async def _write(writer: asyncio.StreamWriter, response: Response, head_only: bool) -> None:
    lines = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Unknown')}",
             f"Content-Type: {response.content_type}", f"Content-Length: {len(response.body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in (*SECURITY_HEADERS, *response.headers))]  # fmt: skip
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    if not head_only:
        writer.write(response.body)
    await writer.drain()
