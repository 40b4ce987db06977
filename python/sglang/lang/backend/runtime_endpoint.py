"""`RuntimeEndpoint`: run programs against an SGLang-compatible HTTP server.

Speaks what upstream's client speaks (docs/frontend.md lists the bodies): GET
/get_model_info once, POST /generate for everything else, POST /flush_cache, GET
/server_info. With `api_key`, every request carries `Authorization: Bearer <key>`.
A non-200 answer raises RuntimeError with the server's message.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, Iterator, Optional

import requests

from sglang.lang.backend.srt_backend import SrtBackend
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path


class RuntimeEndpoint(SrtBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Any = None,
                 chat_template_name: Optional[str] = None,
                 timeout: Optional[float] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout  # seconds per request; None waits as long as generation takes
        self._local = threading.local()  # one keep-alive session per thread
        self.model_info = self._check(self._session().get(
            self.base_url + "/get_model_info", **self._kwargs())).json()
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(self.model_info["model_path"])

    # ------------------------------------------------------------------ HTTP
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _kwargs(self, **extra: Any) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"timeout": self.timeout, **extra}
        if self.api_key:
            kw["headers"] = {"Authorization": f"Bearer {self.api_key}"}
        if self.verify is not None:
            kw["verify"] = self.verify
        return kw

    @staticmethod
    def _check(res: requests.Response) -> requests.Response:
        if res.status_code != 200:
            try:
                content: Any = res.json()
            except ValueError:
                content = res.text
            raise RuntimeError(content)
        return res

    def _post(self, body: Dict[str, Any]) -> Any:
        return self._check(self._session().post(self.base_url + "/generate",
                                                **self._kwargs(json=body))).json()

    def _post_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        res = self._check(self._session().post(self.base_url + "/generate",
                                               **self._kwargs(json=body, stream=True)))
        try:
            for line in res.iter_lines(decode_unicode=False):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                yield json.loads(data)
        finally:
            res.close()  # also tells the server to abort when we stop early

    # ------------------------------------------------------------------ admin
    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def flush_cache(self) -> str:
        return self._check(self._session().post(self.base_url + "/flush_cache",
                                                **self._kwargs())).text

    def get_server_info(self) -> Dict[str, Any]:
        res = self._session().get(self.base_url + "/server_info", **self._kwargs())
        if res.status_code == 404:  # servers before 0.5.10 only have the old name
            res = self._session().get(self.base_url + "/get_server_info", **self._kwargs())
        return self._check(res).json()
