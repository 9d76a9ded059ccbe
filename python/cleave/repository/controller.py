"""The repository controller: the loopback HTTP service the router calls to stage and release
model versions (docs/repository.md, "How a load runs"). The router owns the API clients see
(KServe v2 / Triton repository extension) and which version serves; this process owns the
disk and the processes. Its URL carries a random path segment, so that only the router,
which reads it from its config, can call it.

    POST {base}/index    {}                                    -> {"models": [{name, versions}]}
    POST {base}/load     {"model", "config", "version", "loaded"} -> {"add": [...], "remove": [...]}
                         (config: the version_policy of Triton's config override, or null)
    POST {base}/release  {"model", "versions": [...]}          -> {}
"""

from __future__ import annotations

import json
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cleave.bundle.repository import VersionPolicy, model_policy, scan
from cleave.errors import CleaveError, UsageError
from cleave.repository.served import LoadError, Served

MAX_BODY = 1 << 20


class Controller:
    """What the router's load, unload and index calls do to the repository and processes."""

    def __init__(self, repo: Path, served: Served, changed=lambda: None):
        self.repo = repo
        self.served = served
        self.changed = changed  # called after the versions served changed

    def index(self, _body: dict) -> dict:
        models = scan(self.repo)
        return {
            "models": [
                {"name": name, "versions": [str(v) for v in versions]}
                for name, versions in models.items()
            ]
        }

    def load(self, body: dict) -> dict:
        model = _text(body, "model")
        loaded = [_version(v, "loaded") for v in body.get("loaded") or []]
        present = scan(self.repo).get(model)
        if not present:
            raise LoadError(f"no model {model!r} in the repository {self.repo}", status=404)
        asked = body.get("version")
        if asked not in (None, ""):
            version = _version(asked, "version")
            if version not in present:
                raise LoadError(
                    f"model {model!r} has no version {version} in {self.repo}; it has "
                    f"{sorted(present)}",
                    status=404,
                )
            wanted = sorted({*loaded, version})
        else:
            # The router sends the version_policy of the load's config override, if any.
            config = body.get("config")
            if config is None:
                policy = model_policy(self.repo, model)
            else:
                policy = VersionPolicy.parse(config, "config")
            wanted = policy.select(list(present))
            if not wanted:
                raise LoadError(f"model {model!r}: its version policy selects no version present")
        add = [v for v in wanted if v not in loaded]
        entries = []
        try:
            for v in add:
                entries.append(self.served.stage(model, v, present[v]))
        except CleaveError:
            for v in add[: len(entries)]:
                self.served.release(model, v)
            raise
        self.changed()
        remove = [str(v) for v in loaded if v not in wanted]
        return {"add": entries, "remove": remove}

    def release(self, body: dict) -> dict:
        model = _text(body, "model")
        versions = body.get("versions")
        if not isinstance(versions, list):
            raise LoadError(f"versions: expected a list of version strings, got {versions!r}")
        for v in versions:
            self.served.release(model, _version(v, "versions"))
        self.changed()
        return {}


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise LoadError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _version(value, key: str) -> int:
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise LoadError(f"{key}: expected a version, a positive integer, got {value!r}")
    return int(text)


class ControllerServer:
    """Serves a Controller on loopback; `url` is what the router's config names."""

    def __init__(self, controller: Controller, host: str = "127.0.0.1"):
        token = secrets.token_hex(16)
        routes = {f"/{token}/{name}": (name, getattr(controller, name)) for name in _ROUTES}
        # Every call runs on this one long-lived thread: the processes a load starts are
        # killed when the thread that started them ends (the supervisor's PR_SET_PDEATHSIG
        # follows the thread, not the process), so a request's own thread must not.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="repository")
        worker = self.worker

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the standard library's name)
                if self.path not in routes:
                    return self._answer(404, {"error": "no such controller endpoint"})
                name, call = routes[self.path]
                try:
                    body = self._body()
                    if name == "index":  # reads the disk only: never waits behind a load
                        self._answer(200, call(body))
                    else:
                        self._answer(200, worker.submit(call, body).result())
                except LoadError as err:
                    self._answer(err.status, {"error": str(err)})
                except (CleaveError, UsageError) as err:
                    self._answer(400, {"error": str(err)})

            def _body(self) -> dict:
                length = int(self.headers.get("content-length") or 0)
                if not 0 <= length <= MAX_BODY:
                    raise LoadError(f"body of {length} bytes: expected at most {MAX_BODY}")
                raw = self.rfile.read(length) if length else b"{}"
                try:
                    body = json.loads(raw)
                except ValueError as err:
                    raise LoadError(f"body: expected JSON, got {raw[:80]!r} ({err})") from None
                if not isinstance(body, dict):
                    raise LoadError(f"body: expected a JSON object, got {body!r}")
                return body

            def _answer(self, status: int, value: dict) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):  # the router logs what clients asked
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}/{token}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.worker.shutdown(wait=False, cancel_futures=True)


_ROUTES = ("index", "load", "release")
