"""Static file server bound to 127.0.0.1 that serves .wasm as application/wasm (streaming
compilation needs it). Usage: serve.py PORT DIR"""
import functools
import http.server
import sys

port, directory = int(sys.argv[1]), sys.argv[2]
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
handler.func.extensions_map = {**handler.func.extensions_map, ".wasm": "application/wasm",
                               ".js": "text/javascript"}
with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
    server.serve_forever()
