"""`cleave serve REPO`: every model version a repository's policies select, one router in
front of them all, and the controller that loads and unloads versions while it serves
(docs/repository.md). `cleave serve --plan` of a repository plan: the versions the plan
carries, on its hosts. Every process is under one supervisor; where they run is the
placement's and the hosts' (placement.py, hosts.py): local, on the testbed, or on Ray."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cleave.bundle.repository import scan
from cleave.errors import CleaveError, UsageError
from cleave.launch.supervisor import ChildSpec, find_executable
from cleave.repository.controller import Controller, ControllerServer
from cleave.repository.hosts import LocalHosts
from cleave.repository.placement import LocalPlacement
from cleave.repository.served import Served
from cleave.runners.roles import client_url
from cleave.runners.supervised import keep_router_ports, share_internal_secret
from cleave.settings import ServeConfig
from cleave.settings.router_json import router_config

# Where the router keeps its rollout state, inside the repository: it survives restarts of
# the router and of `cleave serve`.
ROLLOUT_FILE = Path(".cleave") / "rollout.json"


class RepositoryDeployment:
    """start() -> the router's URL; watch(); request_stop(); stop(): as a Runner's. Without a
    `placement` and `hosts`: `cleave serve REPO`'s, on this machine."""

    def __init__(self, repo: Path, config: ServeConfig, log=None, placement=None, hosts=None):
        if config.monolithic or config.router_held:
            raise UsageError(
                "a model repository is served disaggregated: --monolithic and --router-held "
                "take one bundle"
            )
        self.repo = repo
        self.config = config
        self.placement = placement or LocalPlacement(config)
        self.hosts = hosts or LocalHosts(config.host, config.http_port)
        self.supervisor = self.hosts.supervisor(config.fail_stop, log or sys.stderr)
        self.controller: ControllerServer | None = None
        self.served: Served | None = None
        self.config_path: Path | None = None
        self.bound: dict[str, int] = {}  # the ports the router bound at its first start
        self._stopped = False

    def start(self, runtime: Path) -> list[str]:
        try:
            return self._start(runtime)
        except BaseException:
            self.stop()
            raise

    def _start(self, runtime: Path) -> list[str]:
        share_internal_secret(self.config.router.internal_secret_env)
        models = scan(self.repo)
        if not models:
            raise UsageError(
                f"{self.repo}: not a bundle (manifest.json: not found) and not a model "
                "repository (no MODEL/VERSION/ directory in it, VERSION a positive integer)"
            )
        self.hosts.up(runtime, self.supervisor.say)
        # The router's config names its own address: where the hosts put it.
        self.config.host, self.config.http_port = self.hosts.router()
        served = Served(self.config, self.supervisor, runtime, self.placement, self.hosts)
        self.served = served
        for model, v in self.placement.initial(self.repo, models):
            try:
                bundle = models.get(model, {}).get(v)
                if bundle is None:  # a plan's version removed from the disk since
                    raise CleaveError(f"no {self.repo / model / str(v)} in the repository")
                served.stage(model, v, bundle)
            except CleaveError as err:  # as Triton: the others serve, this one is unavailable
                self.supervisor.say(f"{model} version {v} not loaded: {err}")
        if not served.versions:
            raise UsageError(f"model repository {self.repo}: no version could be loaded (above)")
        controller = Controller(self.repo, served, changed=self._write_router_config)
        self.controller = ControllerServer(controller, self.hosts.controller_host)
        self.config_path = runtime / "router.json"
        self._write_router_config()
        host, port = self.config.host, self.config.http_port
        url = client_url(host, port, tls=bool(self.config.router.tls_cert))
        argv = [find_executable("cleave-router"), str(self.config_path)]
        spec = ChildSpec("router", self.hosts.wrap_router(argv), f"http {host}:{port}", probe=url)
        (router,) = self.supervisor.start([spec], self.config.ready_timeout_s)
        keep_router_ports(self.config_path, router.spec)
        bound = json.loads(self.config_path.read_text())
        self.bound = {key: bound[key] for key in ("http_port", "grpc_port") if key in bound}
        names = ", ".join(f"{m}/{v}" for m, v in served.versions)
        self.supervisor.say(f"model repository {self.repo}: serving {names}")
        return [router.spec.probe]

    def _write_router_config(self) -> None:
        """The router's JSON with every version served now: a restarted router comes back
        serving what its predecessor did (and on its ports)."""
        entries = self.served.entries()
        if not entries:  # every version unloaded: a restart keeps the last config
            return
        first, *more = entries
        values = router_config(
            first["model"], Path(first["bundle"]), self.config, first["shards"], first["rankers"]
        )
        rollout = self.repo / ROLLOUT_FILE
        rollout.parent.mkdir(exist_ok=True)
        values |= {
            "version": first["version"],
            "models": more,
            "repository_controller": self.controller.url,
            "rollout_file": str(rollout.resolve()),
            # The rankers' own, which the router's cache budget may lower (docs/cache.md).
            "ranker_max_batch": self.config.ranker.max_batch,
            **self.bound,
        }
        if not values.get("activation_bytes_per_sample") and self.served.activation_bytes:
            values["activation_bytes_per_sample"] = self.served.activation_bytes
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(values, indent=1))
        os.replace(tmp, self.config_path)
        self.hosts.changed(self.config_path)

    def watch(self) -> int:
        return self.supervisor.watch(self.config.ready_timeout_s)

    def request_stop(self) -> None:
        self.supervisor.request_stop()

    def stop(self) -> dict[str, int]:
        if self._stopped:
            return {}
        self._stopped = True
        if self.controller is not None:
            self.controller.close()
        try:
            return self.supervisor.stop(self.config.stop_timeout_s)
        finally:
            self.hosts.down()
