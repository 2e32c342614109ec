"""The request handler the fake HTTP servers share: it writes no access log and answers JSON with its length."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet handler (each fake records the requests it cares about) with :meth:`send_json` and :meth:`send_body`."""

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def send_body(self, status: int, data: bytes, content_type: str) -> None:
        """Answer ``status`` with ``data`` as the whole body, its type and length in the headers."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status: int, body: Any) -> None:
        """Answer ``status`` with ``body`` written as JSON."""
        self.send_body(status, json.dumps(body).encode(), "application/json")
