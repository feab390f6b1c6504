"""A live server on 127.0.0.1 for the server tests: uvicorn in a thread around a given engine, the
records of its loggers, and a tokenizer whose encode can be held to observe what the event loop does
meanwhile."""

from __future__ import annotations

import contextlib
import logging
import threading

from meshtron.inference.server import build_server
from meshtron.testing.multiprocess import free_port
from tests.inference.helpers import wait_ready


@contextlib.contextmanager
def live_server(engine, **options):
    """-> (url, server, state); the server stops when the block ends."""
    port = free_port()
    server, state = build_server(lambda: engine, "127.0.0.1", port, log_level=options.pop("log_level", "warning"),
                                 **options)
    runner = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    runner.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url, server, state
    finally:
        server.should_exit = True
        runner.join(timeout=60)


class Records(logging.Handler):
    """Every record of uvicorn's and the server's loggers while installed."""

    NAMES = ("uvicorn", "meshtron")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


class GatedTokenizer:
    """Wraps a tokenizer; `encode` of a text starting with `gate` waits for `release` (set by the test)
    after setting `entered`. `lengths` records the length of every text encoded."""

    def __init__(self, inner, gate: str = "BIG"):
        self.inner, self.gate = inner, gate
        self.entered, self.release = threading.Event(), threading.Event()
        self.lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        if text.startswith(self.gate):
            self.entered.set()
            self.release.wait(25)
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)
