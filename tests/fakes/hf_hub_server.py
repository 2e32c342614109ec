"""A stand-in for the Hugging Face Hub's HTTP API on loopback, for ``lmforge push`` up to the network boundary.

Only the calls ``HfApi.create_repo`` and ``HfApi.upload_folder`` make for small files are answered, with the shapes
``huggingface_hub`` parses (``hf_api.py``: ``create_repo`` reads ``url``; ``_fetch_upload_modes`` posts
``/api/{repo_type}s/{repo_id}/preupload/{revision}`` and reads ``files[].uploadMode``/``shouldIgnore``;
``create_commit`` posts NDJSON to ``/api/{repo_type}s/{repo_id}/commit/{revision}`` — a ``header`` line, then one
``file`` line per file with base64 ``content`` for "regular" uploads — and reads ``commitUrl``/``commitOid``).
Every file is answered as "regular", so no LFS or Xet transfer is involved. ``upload_folder`` first posts the
README to ``/api/validate-yaml``; the Hub's server-side card rules are not public code, so the stand-in records the
card and accepts it (the card's own parsing is tested with ``huggingface_hub.ModelCard``). Requests without the
expected bearer
token get 401, as the Hub answers them.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import ThreadingHTTPServer

from tests.fakes.json_handler import JsonHandler


class FakeHub:
    """``with FakeHub(token) as hub``: ``hub.url`` is the endpoint; ``hub.repos`` and ``hub.files`` what arrived."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: list[str] = []
        self.files: dict[str, dict[str, bytes]] = {}
        self.unexpected: list[str] = []
        self.validated: list[str] = []
        hub = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self.send_json(401, {"error": "Invalid credentials in Authorization header"})
                    return
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    request = json.loads(body)
                    repo = f"{request.get('organization')}/{request['name']}"
                    hub.repos.append(repo)
                    self.send_json(200, {"url": f"{hub.url}/{repo}", "name": repo})
                elif parts == ["api", "validate-yaml"]:
                    hub.validated.append(json.loads(body)["content"])
                    self.send_json(200, {"errors": [], "warnings": []})
                elif parts[:2] == ["api", "models"] and parts[4:5] == ["preupload"]:
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    self.send_json(200, {"files": modes, "commitOid": "0" * 40})
                elif parts[:2] == ["api", "models"] and parts[4:5] == ["commit"]:
                    repo = "/".join(parts[2:4])
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item.get("key") == "file":
                            value = item["value"]
                            hub.files.setdefault(repo, {})[value["path"]] = base64.b64decode(value["content"])
                    self.send_json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40})
                else:
                    hub.unexpected.append(f"POST {self.path}")
                    self.send_json(404, {"error": "not in the stand-in"})

            def do_GET(self) -> None:
                hub.unexpected.append(f"GET {self.path}")
                self.send_json(404, {"error": "not in the stand-in"})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
