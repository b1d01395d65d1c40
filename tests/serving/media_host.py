"""A real HTTP server on 127.0.0.1 for the tests of fetched media (edits' `url`, chat media
parts): files by path, redirects, and a path that answers only once the test lets it (a server
that never finishes in time, with no sleep anywhere). Counts every request it receives."""

from __future__ import annotations

import http.server
import threading


class MediaHost:
    def __init__(self, files: dict[str, bytes], redirects: dict[str, str] | None = None):
        self.files = files
        self.redirects = redirects or {}
        self.requests: list[str] = []
        self.release = threading.Event()  # /hold answers once this is set
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                host.requests.append(self.path)
                if self.path in host.redirects:
                    self.send_response(302)
                    self.send_header("Location", host.redirects[self.path])
                    self.end_headers()
                    return
                if self.path == "/hold":
                    host.release.wait(60)
                body = host.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> MediaHost:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
