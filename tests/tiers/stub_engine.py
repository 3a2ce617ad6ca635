"""A stand-in engine process for supervisor tests: answers /health on the port it is given.

Like the real engine it reports the nonce the supervisor passed in TIERGATE_ENGINE_INSTANCE as `instance`.
An optional second argument names a file whose content picks the next /health answer, so a test can turn
a running stub sick: `ok` (or no file), `dead` (503 {"status": "dead"}, as an engine whose loop died),
`hang` (never answers), `hang-once` (never answers this probe, then back to `ok`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODE_FILE = Path(sys.argv[2]) if len(sys.argv) > 2 else None


def mode() -> str:
    try:
        return MODE_FILE.read_text().strip() if MODE_FILE else "ok"
    except FileNotFoundError:
        return "ok"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body = 404, {"error": "not found"}
        if self.path == "/health":
            now = mode()
            if now == "hang-once":
                MODE_FILE.write_text("ok")  # type: ignore[union-attr]
            if now.startswith("hang"):
                time.sleep(3600)
            status, body = (503, {"status": "dead"}) if now == "dead" else \
                (200, {"status": "ok", "instance": os.environ.get("TIERGATE_ENGINE_INSTANCE")})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
