"""An HTTP server in the standard library only (it runs in a guest with python3): ``python3
httpecho.py PORT``. GET answers the request's path and headers as JSON; POST answers the body's
length and sha256. Test data, not a product."""

import hashlib
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Echo(BaseHTTPRequestHandler):
    def _answer(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer(
            {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
        )

    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
