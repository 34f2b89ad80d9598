"""A small HTTP server with byte ranges that fails on purpose (native-runner/tests/it/remote.rs).

    python3 faulty_http.py ROOT MODE [N]

Serves the files under ROOT on 127.0.0.1 (a free port, printed as `ready PORT` once listening) with
`HEAD` and `GET` with a `Range: bytes=A-B` header. MODE:

- `short`: a range response of more than 64 bytes promises its full length in Content-Length, sends
  half of it and closes the connection (a body cut short).
- `die N`: serves N GET requests, then stops listening and exits (a server gone mid-transfer).
- `flaky`: every other GET answers 503 Service Unavailable (a transient failure to retry).
- `ok`: serves everything (to check the server itself).
"""

import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.realpath(sys.argv[1])
MODE = sys.argv[2]
LIMIT = int(sys.argv[3]) if len(sys.argv) > 3 else 0
served = 0
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def file(self):
        path = os.path.realpath(os.path.join(ROOT, self.path.split("?")[0].lstrip("/")))
        if not path.startswith(ROOT + os.sep) or not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def do_HEAD(self):
        path = self.file()
        if path is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(os.path.getsize(path)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self):
        global served
        with lock:
            served += 1
            count = served
        if MODE == "die" and count > LIMIT:
            os._exit(0)
        if MODE == "flaky" and count % 2 == 1:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = self.file()
        if path is None:
            return
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            data = f.read()
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m is None:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(data)
            return
        start = int(m.group(1))
        end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if MODE == "short" and len(body) > 64:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(f"ready {server.server_address[1]}", flush=True)
server.serve_forever()
