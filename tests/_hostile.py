"""A lying engine: a real HTTP server on loopback that speaks just enough of SGLang's API to be
attached as an external engine, and then answers each route the way a test tells it to.

Behaviours (per route, changeable while it runs):

- ``ok``: what a healthy SGLang engine answers;
- ``garbage``: a 200 whose body is not what SGLang sends (truncated JSON, wrong shapes);
- ``huge``: a 200 whose body is ``HUGE_BYTES`` long, streamed without a Content-Length;
- ``trickle``: a 200 whose body arrives one byte every ``TRICKLE_SECS``, forever;
- ``cut``: a 200 that promises a longer body than it sends, then closes the connection;
- ``hang``: never answers (holds the connection until the server stops);
- ``wrong_version``: ``/model_info`` names another weight version;
- ``error``: HTTP 500;
- ``drop_once``: closes the connection without answering, once; then ``ok`` (a connection lost
  on the way, not a dead engine).

Streaming bodies stop as soon as the client goes away, so a manager that gives up early costs
this process nothing either.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HUGE_BYTES = 100 * 1024 * 1024
TRICKLE_SECS = 0.2
CHUNK = b" " * (64 * 1024)

MODEL_PATH = "sim-model"


def ok_body(path: str, weight_version: str) -> bytes:
    if path == "/model_info":
        info = {"model_path": MODEL_PATH, "weight_version": weight_version, "is_generation": True}
        return json.dumps(info).encode()
    if path == "/v1/loads":
        rank = {
            "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
            "max_total_num_tokens": 100000, "token_usage": 0.0, "gen_throughput": 0.0,
            "num_waiting_uncached_tokens": 0,
        }  # fmt: skip
        return json.dumps({"timestamp": 0, "loads": [rank]}).encode()
    if path == "/metrics":
        return (
            b'sglang:num_running_reqs{dp_rank="0"} 0\n'
            b'sglang:num_queue_reqs{dp_rank="0"} 0\n'
            b'sglang:token_usage{dp_rank="0"} 0\n'
        )
    if path in ("/generate", "/v1/completions"):
        return json.dumps({"text": " hostile", "meta_info": {"id": "h", "completion_tokens": 1}}).encode()
    return b"{}"


GARBAGE = {
    "/model_info": b'{"model_path": [1, 2',
    "/v1/loads": b'{"loads": "many"}',
    "/metrics": b"sglang:token_usage{oops 1\nnot metrics at all",
    "/generate": b"<html>not json</html>",
}


class HostileEngine:
    """The server and its behaviour table; ``url`` is where it listens."""

    def __init__(self, weight_version: str = "default") -> None:
        self.behaviour: dict[str, str] = {}
        self.weight_version = weight_version
        #: requests seen, by path
        self.hits: Counter[str] = Counter()
        #: the Authorization headers of the requests seen (None when absent), in order
        self.authorizations: list[str | None] = []
        self.stopping = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                engine.answer(self)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                engine.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def set(self, mode: str, *paths: str) -> None:
        for path in paths:
            self.behaviour[path] = mode

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?", 1)[0]
        self.hits[path] += 1
        self.authorizations.append(handler.headers.get("Authorization"))
        mode = self.behaviour.get(path, "ok")
        try:
            if mode == "hang":
                self.stopping.wait()
                return
            if mode == "drop_once":
                self.behaviour[path] = "ok"
                handler.close_connection = True
                return
            if mode == "error":
                self.send(handler, 500, b'{"error": "boom"}')
            elif mode == "garbage":
                self.send(handler, 200, GARBAGE.get(path, b"\x00garbage"))
            elif mode == "wrong_version" and path == "/model_info":
                info = {"model_path": MODEL_PATH, "weight_version": "v-from-elsewhere"}
                self.send(handler, 200, json.dumps(info).encode())
            elif mode == "huge":
                self.stream(handler, HUGE_BYTES, 0.0)
            elif mode == "trickle":
                self.stream(handler, None, TRICKLE_SECS)
            elif mode == "cut":
                body = ok_body(path, self.weight_version)
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(body) + 100))
                handler.end_headers()
                handler.wfile.write(body)
                handler.close_connection = True
            else:
                self.send(handler, 200, ok_body(path, self.weight_version))
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def stream(self, handler: BaseHTTPRequestHandler, total: int | None, pause: float) -> None:
        """A 200 whose body has no declared length: ``total`` bytes, or one byte every
        ``pause`` seconds until the client leaves (``total`` None)."""
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        handler.wfile.write(b'{"model_path": "')
        sent = 0
        while not self.stopping.is_set() and (total is None or sent < total):
            if pause:
                handler.wfile.write(b"x")
                handler.wfile.flush()
                self.stopping.wait(pause)
                sent += 1
            else:
                handler.wfile.write(CHUNK)
                sent += len(CHUNK)

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
