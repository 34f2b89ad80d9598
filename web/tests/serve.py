"""Static file server bound to 127.0.0.1 that serves .wasm as application/wasm (streaming
compilation needs it) and honours single `Range: bytes=a-b` requests (206 + Content-Range; the
viewer opens checkpoints by URL with them). Usage: serve.py PORT DIR [--verbose]"""
import functools
import http.server
import os
import re
import shutil
import sys

port, directory = int(sys.argv[1]), sys.argv[2]
RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".wasm": "application/wasm", ".js": "text/javascript"}

    def send_head(self):
        header = self.headers.get("Range")
        path = self.translate_path(self.path)
        if header is None or not os.path.isfile(path):
            return super().send_head()
        m = RANGE.match(header.strip())
        size = os.path.getsize(path)
        if not m or (m.group(1) == "" and m.group(2) == ""):
            self.send_error(416, "unsupported Range")
            return None
        if m.group(1) == "":  # suffix range: the last N bytes
            start, end = max(0, size - int(m.group(2))), size - 1
        else:
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        if start >= size or end < start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")  # noqa: SIM115 (closed by copyfile)
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._remaining = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return shutil.copyfileobj(source, outputfile)
        try:
            while remaining > 0:
                buf = source.read(min(remaining, 1 << 20))
                if not buf:
                    break
                outputfile.write(buf)
                remaining -= len(buf)
        finally:
            self._remaining = None

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if "--verbose" in sys.argv:
            super().log_message(format, *args)


handler = functools.partial(Handler, directory=directory)
with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
    server.serve_forever()
