"""The gunicorn worker of `llmq web`: gthread, plus a `StreamServer` for event streams.

`gunicorn -k webapp.stream_worker.StreamWorker`. Requests are served by gthread's threads
as usual. A view that streams events (webapp/events.py, webapp/openai_api.py) finds the
process's `StreamServer` in its environ, validates the request, puts its stream under
`DETACHED_KEY` and returns an empty response; this worker then sends the headers (with
`Connection: close`), hands the socket to the stream server and frees the thread. The
socket object moves over whole: gunicorn neither closes it nor writes a chunked
terminator; the stream server ends the response.

Threads, not gevent: gevent's monkey patching removes `select.epoll`, and importing
transformers' tokenizer stack (huggingface_hub 2.x) then fails; plain threads need no
patching, and blocking drivers (psycopg, tokenizers) stay blocking.
"""

from __future__ import annotations

import socket
from datetime import datetime
from typing import Any

from gunicorn import http
from gunicorn.http import wsgi
from gunicorn.workers.gthread import ThreadWorker

from webapp.stream_server import DETACHED_KEY, STREAM_SERVER_KEY, StreamServer


class StreamWorker(ThreadWorker):
    """gthread whose streaming responses are served by a `StreamServer`."""

    stream_server: StreamServer | None = None
    alive: bool  # gunicorn's worker sets it; declared for the type checker

    def init_process(self) -> None:
        # NOTE: after the fork: the server's threads must live in the worker process
        self.stream_server = StreamServer()
        self._detached: set[int] = set()  # id() of connections the stream server took
        super().init_process()

    def run(self) -> None:
        try:
            super().run()
        finally:
            if self.stream_server is not None:
                self.stream_server.close()

    def finish_request(self, conn: Any, fs: Any) -> None:
        if id(conn) in self._detached:  # NOTE: main thread only, like the base class
            self._detached.discard(id(conn))
            self.nr_conns -= 1
            return
        super().finish_request(conn, fs)

    def handle_request(self, req: http.Request, conn: Any) -> bool:
        if type(conn.sock) is not socket.socket:  # TLS: the threads stream, as before
            return super().handle_request(req, conn)
        environ: dict[str, Any] = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            started = datetime.now()
            resp, environ = wsgi.create(req, conn.sock, conn.client, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            environ[STREAM_SERVER_KEY] = self.stream_server
            self.nr += 1
            if self.nr >= self.max_requests:
                if self.alive:
                    self.log.info("Autorestarting worker after current request.")
                    self.alive = False
                resp.force_close()
            if not self.alive or not self.cfg.keepalive:
                resp.force_close()
            elif len(self.keepalived_conns) >= self.max_keepalived:
                resp.force_close()
            body = self.wsgi(environ, resp.start_response)
            try:
                factory = environ.get(DETACHED_KEY)
                # NOTE: HEAD gets the headers only, through the usual path
                if factory is not None and resp.status_code == 200 and req.method != "HEAD":
                    for _ in body:
                        pass  # an empty body: Flask's teardown runs on close below
                    resp.force_close()  # the stream server closes the connection
                    resp.send_headers()
                    assert self.stream_server is not None
                    self.stream_server.adopt(conn.sock, resp.chunked, factory)
                    self._detached.add(id(conn))
                    return False
                if isinstance(body, environ["wsgi.file_wrapper"]):
                    resp.write_file(body)
                else:
                    for item in body:
                        resp.write(item)
                resp.close()
            finally:
                self.log.access(resp, req, environ, datetime.now() - started)
                if hasattr(body, "close"):
                    body.close()
            return not resp.should_close()
        except OSError:
            raise
        except (Exception, SystemExit):
            if resp is not None and resp.headers_sent:
                self.log.exception("Error handling request")
                conn.close(graceful=True)
                raise StopIteration() from None
            raise
        finally:
            try:
                self.cfg.post_request(self, req, environ, resp)
            except Exception:
                self.log.exception("Exception in post_request hook")

