"""The results file: JSONL, one record per (document, question), safe to kill at any time.

Invariants: a record is appended as one line ending in "\\n", flushed and fsync'd before
the job counts it done; a line without its "\\n" is the trace of a kill mid-write and is
cut off when the file is opened again; no key is ever written twice. Only one job may
write a file at a time (an exclusive flock, released when the process dies).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from typing import Any, Dict, List, Tuple

logger = logging.getLogger(__name__)

Key = Tuple[str, str]  # (doc_id, question_id)


def record_key(record: Dict[str, Any]) -> Key:
    return record["doc_id"], record["question_id"]


class ResultStore:
    def __init__(self, path: str) -> None:
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self._file = open(path, "ab")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise SystemExit(f"{path}: another review job is writing this file")
        self._lock = threading.Lock()
        self.records: List[Dict[str, Any]] = self._recover()
        self.done: Dict[Key, Dict[str, Any]] = {}
        for rec in self.records:
            self.done.setdefault(record_key(rec), rec)

    def _recover(self) -> List[Dict[str, Any]]:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1  # bytes up to the last complete line
        if end < len(data):
            logger.warning("%s: dropping a partial last line (%d bytes) left by a kill",
                           self.path, len(data) - end)
            self._file.truncate(end)
            self._sync()
        records = []
        for lineno, line in enumerate(data[:end].split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                raise SystemExit(f"{self.path}:{lineno}: not a JSON record; fix or remove "
                                 "the line, or write to a new --out file") from None
        return records

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def append(self, record: Dict[str, Any]) -> bool:
        """Write `record` durably; False (and nothing written) if its key is done."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        key = record_key(record)
        with self._lock:
            if key in self.done:
                return False
            self._file.write(line)
            self._sync()
            self.done[key] = record
            self.records.append(record)
        return True

    def close(self) -> None:
        self._file.close()  # also releases the flock
