"""A lean HTTP/1.1 JSON client for the load generator: one kept-alive
connection, one request at a time, on asyncio streams.

The load generator shares the machine with the system it measures; httpx
spends ~1.3 ms of CPU per request here, this ~0.2 ms, so the measurement
takes less of the cores the system runs on. It speaks only what the benches
need (GET, POST of a JSON body, a response with Content-Length, and an SSE
stream read on a connection of its own) and fails loudly on anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class Http1Client:
    def __init__(self, base_url: str, headers: dict[str, str], timeout: float = 120.0) -> None:
        """`timeout`: the most a response, or a stream's next chunk, may
        take (s); then TimeoutError, the connection closed."""
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname or not url.port:
            raise ValueError(f"need http://host:port, got {base_url!r}")
        self.host, self.port = url.hostname, url.port
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.timeout = timeout
        self._head = (f"Host: {self.host}:{self.port}\r\n"
                      "Content-Type: application/json\r\n" + extra)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        """(status, decoded JSON body). A kept-alive connection the server
        closed is reopened and the request sent once more: a POST whose
        repetition matters carries a client_request_id."""
        return await self._request("POST", path, json.dumps(body).encode())

    async def get_json(self, path: str) -> tuple[int, Any]:
        """(status, decoded JSON body), as post_json."""
        return await self._request("GET", path, b"")

    async def sse_events(self, path: str) -> AsyncIterator[dict[str, Any]]:
        """The `data:` payloads (decoded JSON) of a GET's event stream, on a
        connection of its own, closed when the caller stops iterating (an
        unfinished stream cannot carry the next request)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\n{self._head}\r\n".encode())
            status, headers = await asyncio.wait_for(_read_head(reader), self.timeout)
            if status != 200 or headers.get("transfer-encoding") != "chunked":
                raise RuntimeError(f"GET {path}: {status}, {headers}")
            pending = b""
            while chunk := await asyncio.wait_for(_read_chunk(reader), self.timeout):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        yield json.loads(line[5:])
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _request(self, method: str, path: str, payload: bytes) -> tuple[int, Any]:
        request = (f"{method} {path} HTTP/1.1\r\n{self._head}"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    return await self._exchange(request)
                except (ConnectionError, asyncio.IncompleteReadError):
                    await self.aclose()
                    return await self._exchange(request)
        except TimeoutError:
            await self.aclose()  # a late response would answer the next request
            raise TimeoutError(f"{method} {path}: no response in {self.timeout} s") from None

    async def _exchange(self, request: bytes) -> tuple[int, Any]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(request)
        status, headers = await _read_head(self._reader)
        if "transfer-encoding" in headers:
            raise RuntimeError(f"unsupported response: transfer-encoding "
                               f"{headers['transfer-encoding']}")
        if "content-length" not in headers:
            raise RuntimeError("unsupported response: no Content-Length")
        data = await self._reader.readexactly(int(headers["content-length"]))
        if headers.get("connection", "").lower() == "close":
            await self.aclose()
        return status, json.loads(data) if data else None

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
        self._reader = self._writer = None


async def _read_chunk(reader: asyncio.StreamReader) -> bytes:
    """The next chunk of a chunked body; b"" for the last one."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    if not size:
        return b""
    data = await reader.readexactly(size)
    await reader.readexactly(2)  # the chunk's CRLF
    return data


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status and headers (names lower-cased)."""
    status_line = await reader.readuntil(b"\r\n")
    if not status_line:
        raise ConnectionError("connection closed")
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(b" ", 2)[1]), headers
