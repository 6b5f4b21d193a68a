"""A loopback OpenAI-compatible chat-completions server for the tests.

It is the external part (as the replay model is): it speaks the wire
protocol, non-streaming and streaming (text deltas, tool-call deltas and a
usage chunk), fails on demand, streams slowly, and records every request
(headers and body) so tests can assert what the worker sent.

    with FakeProvider() as fake:
        fake.script([Reply(text="hi"), Reply(status=500), ...])  # in order
        fake.base_url  -> "http://127.0.0.1:<port>/v1"
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {name, args}
    usage: tuple[int, int] = (11, 7)
    status: int = 200
    error: str = "boom"
    headers: dict[str, str] = field(default_factory=dict)
    chunk_size: int = 4
    chunk_delay: float = 0.0
    # Close the connection after this many text chunks (a broken stream).
    break_after: int | None = None
    # Only answer requests whose last user text contains this (else next rule).
    match: str | None = None


@dataclass
class Request:
    headers: dict[str, str]
    body: dict[str, Any]
    at: float
    closed_at: float | None = None  # when the client went away mid-stream


class FakeProvider:
    def __init__(self, default: Reply | None = None) -> None:
        self.requests: list[Request] = []
        self._queue: list[Reply] = []
        self.default = default or Reply(text="fake answer")
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                req = Request({k.lower(): v for k, v in self.headers.items()}, body,
                              time.monotonic())
                with fake._lock:
                    fake.requests.append(req)
                reply = fake._next(body)
                try:
                    fake._answer(self, reply, body, req)
                except (BrokenPipeError, ConnectionResetError):
                    req.closed_at = time.monotonic()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeProvider:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def script(self, replies: list[Reply]) -> None:
        with self._lock:
            self._queue.extend(replies)

    def _next(self, body: dict[str, Any]) -> Reply:
        last_user = next((m.get("content") for m in reversed(body.get("messages", []))
                          if m.get("role") == "user"), "") or ""
        with self._lock:
            for i, reply in enumerate(self._queue):
                if reply.match is None or reply.match in str(last_user):
                    return self._queue.pop(i)
        return self.default

    # ------------------------------------------------------------------

    @staticmethod
    def _send_json(h: BaseHTTPRequestHandler, status: int, data: Any,
                   headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(raw)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(raw)

    def _answer(self, h: BaseHTTPRequestHandler, reply: Reply, body: dict[str, Any],
                req: Request) -> None:
        if reply.status != 200:
            self._send_json(h, reply.status, {"error": {"message": reply.error,
                                                        "type": "fake_error"}},
                            reply.headers)
            return
        calls = [{"id": f"call_{i}_{int(time.time() * 1e6)}", "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c.get("args", {}))}}
                 for i, c in enumerate(reply.tool_calls)]
        prompt, completion = reply.usage
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        cid = f"chatcmpl-{int(time.time() * 1e6)}"
        model = body.get("model", "fake")
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
            if calls:
                message["tool_calls"] = calls
            self._send_json(h, 200, {
                "id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": model, "usage": usage,
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if calls else "stop"}]})
            return
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("connection", "close")
        h.end_headers()

        def chunk(delta: dict[str, Any], finish: str | None = None,
                  extra: dict[str, Any] | None = None) -> None:
            data = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    **(extra or {})}
            h.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            h.wfile.flush()

        chunk({"role": "assistant", "content": ""})
        pieces = [reply.text[i:i + reply.chunk_size]
                  for i in range(0, len(reply.text), reply.chunk_size)]
        for n, piece in enumerate(pieces):
            if reply.break_after is not None and n >= reply.break_after:
                h.close_connection = True
                return  # the connection closes mid-answer
            if reply.chunk_delay:
                time.sleep(reply.chunk_delay)
            chunk({"content": piece})
        for i, call in enumerate(calls):
            args = call["function"]["arguments"]
            chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"],
                                                "arguments": ""}}]})
            for j in range(0, len(args), 5):
                chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j:j + 5]}}]})
        chunk({}, "tool_calls" if calls else "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            data = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [], "usage": usage}
            h.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()
