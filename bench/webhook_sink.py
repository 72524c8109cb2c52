#!/usr/bin/env python3
"""The webhook receiver of scripts/bench's soak, with the standard library only.

    webhook_sink.py PORT

Listens on 127.0.0.1:PORT and answers every POST 200 with an empty body,
after reading the request's body; keeps connections alive (HTTP/1.1), as a
real receiver would, so the service's client reuses them. It checks nothing:
the soak counts deliveries in the database, where the service records them.
Stops on SIGTERM or Ctrl-C.
"""

import http.server
import signal
import sys


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):
        pass


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
