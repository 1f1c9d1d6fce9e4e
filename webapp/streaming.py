"""The response of a streaming view: handed to the stream server, or streamed by the thread.

A view builds its stream with a factory `(sink, cooperative) -> Iterator[str | Park]`:
under `llmq web` (webapp/stream_worker.py) it is called with the stream server's socket as
the sink and `cooperative=True`, after the view returned (see webapp/stream_server.py);
under any other server, with the thread's own sink (webapp/sse_sink.py, or None) and
`cooperative=False`, by the response iterator, as a plain generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flask import Response, request, stream_with_context

from tasks.streams.live_hub import Sink
from tasks.streams.reader import Park
from webapp.sse_sink import SocketSink
from webapp.stream_server import DETACHED_KEY, STREAM_SERVER_KEY

StreamBuilder = Callable[[Sink | None, bool], Iterator[str | Park]]


def event_stream_response(build: StreamBuilder,
                          headers: dict[str, str] | None = None) -> Response:
    """A `text/event-stream` response of the stream `build` makes (read the request
    before: the stream may run after the request context is gone)."""
    environ = request.environ
    if environ.get(STREAM_SERVER_KEY) is not None:
        environ[DETACHED_KEY] = lambda sink: build(sink, True)
        body: Iterator[str] = iter(())  # the worker sends the headers and hands over
    else:
        body = stream_with_context(_blocking(build(SocketSink.for_request(environ), False)))
    response = Response(body, mimetype="text/event-stream", headers=headers)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # nginx: do not buffer the stream
    return response


def _blocking(stream: Iterator[str | Park]) -> Iterator[str]:
    for item in stream:
        assert not isinstance(item, Park), "a blocking stream never parks"
        yield item
