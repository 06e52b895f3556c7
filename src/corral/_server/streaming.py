"""The NDJSON answer of a long call (a streamed command, a code cell): the call runs in a worker
thread and its events go out as lines the moment they come, a keepalive line while it is quiet
(proxies close idle connections), its last event when it ends, or an error line."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._http.errorlog import log_stream_error
from ..errors import CorralError

__all__ = ["KEEPALIVE_S", "ndjson_stream"]

Event = dict[str, Any]

#: Seconds of quiet before a keepalive line.
KEEPALIVE_S = 15.0


def ndjson_stream(work: Callable[[Callable[[Event], None]], Event], *, what: str,
                  thread_name: str) -> Iterator[bytes]:
    """Run ``work(emit)`` in a thread: each event it ``emit``s is a line, then the event it
    returns; a ``CorralError`` it raises ends the stream with ``{"type": "error", "error",
    "message"}`` (logged as ``what``'s, when a server error)."""
    events: queue.Queue[Event | None] = queue.Queue()

    def run() -> None:
        try:
            events.put(work(events.put))
        except CorralError as exc:
            log_stream_error("api", what, exc, exc.status)
            events.put({"type": "error", "error": exc.code, "message": exc.message})
        finally:
            events.put(None)

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    while True:
        try:
            event = events.get(timeout=KEEPALIVE_S)
        except queue.Empty:
            yield b'{"type":"keepalive"}\n'
            continue
        if event is None:
            return
        yield (json.dumps(event) + "\n").encode()
