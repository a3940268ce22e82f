"""HTTP calls to one `python -m sglang.launch_server` process (or a router in front of several).

Only the standard library: the adapter must import without SGLang or an HTTP client package. Every
route and body key used here exists in the pinned release's http_server.py / io_struct.py (checked by
tests/test_sglang_contract.py). A `Transport` is injectable so unit tests can record the calls; a
recording transport is never SGLang.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional, Protocol

DEFAULT_GROUP = "weight_update_group"  # the release's default group_name


class SGLangHTTPError(RuntimeError):
    """An SGLang server answered with an error status, or could not be reached."""


class Transport(Protocol):
    def request(self, method: str, url: str, body: Optional[dict], timeout: float) -> Any:
        """Send JSON (or nothing), return the decoded JSON answer (None for an empty body)."""
        ...


class UrllibTransport:
    """JSON over urllib; raises SGLangHTTPError with the server's message on a non-2xx status."""

    def request(self, method: str, url: str, body: Optional[dict], timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise SGLangHTTPError(f"{method} {url} -> HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise SGLangHTTPError(f"{method} {url} failed: {e}") from e
        return json.loads(raw) if raw.strip() else None


class ServerClient:
    """The routes of one SGLang server (or router) the adapter uses."""

    def __init__(self, url: str, transport: Optional[Transport] = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.transport = transport or UrllibTransport()
        self.timeout_s = timeout_s

    def _post(self, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        return self.transport.request("POST", self.url + path, body, timeout or self.timeout_s)

    def _get(self, path: str, timeout: Optional[float] = None) -> Any:
        return self.transport.request("GET", self.url + path, None, timeout or self.timeout_s)

    @staticmethod
    def _check(answer: Any, what: str) -> Any:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangHTTPError(f"{what} failed: {answer.get('message')}")
        return answer

    # ------------------------------------------------------------------------------------ generation
    def generate(self, body: dict) -> dict:
        return self._post("/generate", body)

    # ---------------------------------------------------------------------------------------- status
    def is_healthy(self, timeout: float = 5.0) -> bool:
        try:
            self._get("/health", timeout=timeout)
            return True
        except SGLangHTTPError:
            return False

    def model_info(self) -> dict:
        return self._get("/model_info", timeout=30.0)

    def server_info(self) -> dict:
        return self._get("/server_info", timeout=30.0)

    def flush_cache(self) -> Any:
        return self._post("/flush_cache", None, timeout=60.0)

    # ---------------------------------------------------------------------------------------- weights
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> Any:
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return self._check(self._post("/init_weights_update_group", body), "init_weights_update_group")

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> Any:
        return self._check(self._post("/destroy_weights_update_group", {"group_name": group_name}),
                           "destroy_weights_update_group")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str = DEFAULT_GROUP, flush_cache: bool,
                                        weight_version: Optional[str], load_format: Optional[str]) -> Any:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": bool(flush_cache), "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._check(self._post("/update_weights_from_distributed", body), "update_weights_from_distributed")

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: Optional[str],
                                   flush_cache: bool, weight_version: Optional[str] = None) -> Any:
        """Here only the FP4 reload's framing calls (empty tensor lists, custom_loader.py): tensors themselves
        would travel as CUDA IPC handles, which only work on the server's own host."""
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._check(self._post("/update_weights_from_tensor", body), "update_weights_from_tensor")

    def weights_checksum(self) -> Optional[str]:
        """The release's own hash of every parameter as installed (post-processed layouts), all TP ranks.

        It hashes SGLang's internal tensors, so it cannot be compared with our digests -- only with itself:
        across servers after the same update, or before/after re-sending the same bytes.
        """
        answer = self._check(self._post("/weights_checker", {"action": "checksum"}, timeout=600.0), "weights_checker")
        return answer.get("per_engine_checksum") if isinstance(answer, dict) else None

    # ----------------------------------------------------------------------------------------- memory
    def release_memory_occupation(self) -> Any:
        return self._post("/release_memory_occupation", {"tags": None})

    def resume_memory_occupation(self) -> Any:
        return self._post("/resume_memory_occupation", {"tags": None})
