"""The launcher's `/metrics` endpoint: the exposition its scrape function renders, on a thread."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable


def serve_metrics(
    scrape: Callable[[], str], host: str, port: int
) -> http.server.ThreadingHTTPServer:
    """Serve `scrape()` at /metrics on a daemon thread; anything else is a 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = scrape().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="pagekeeper-metrics", daemon=True).start()
    return server
