"""`--request-log DIR`: one JSON line per request (ids, timings, usage, cache hits; never
prompt or output text), appended to DIR/requests.jsonl by a background thread so a
slow disk never delays a response."""
from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path

_STOP = object()


class RequestLog:
    def __init__(self, directory):
        self.path = Path(directory) / "requests.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="xlr-request-log",
                                        daemon=True)
        self._thread.start()

    def write(self, entry: dict) -> None:
        """Queue one entry (returns at once)."""
        self._queue.put(entry)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _write(self) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            while (entry := self._queue.get()) is not _STOP:
                try:
                    f.write(json.dumps(entry, default=str) + "\n")
                    if self._queue.empty():
                        f.flush()
                except (OSError, TypeError, ValueError) as e:  # keep serving without a log
                    print(f"request log: {e}", file=sys.stderr)
