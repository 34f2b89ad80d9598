"""Static file server bound to 127.0.0.1 that serves .wasm as application/wasm (streaming
compilation needs it). Usage: serve.py PORT DIR"""
import functools
import http.server
import sys

port, directory = int(sys.argv[1]), sys.argv[2]


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".wasm": "application/wasm", ".js": "text/javascript"}

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if "--verbose" in sys.argv:
            super().log_message(format, *args)


handler = functools.partial(Handler, directory=directory)
with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
    server.serve_forever()
