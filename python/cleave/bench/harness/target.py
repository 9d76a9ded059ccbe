"""Where a benchmark's load goes: a `cleave serve` it starts (a bundle with flags, or a plan
under a runner) and can restart, or the URL of a deployment someone else runs."""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cleave.bench.harness.workload import Workload


class Target:
    """One deployment under load; `with target:` starts and stops it."""

    def __init__(
        self,
        bundle=None,
        flags: list[str] | None = None,
        url: str | None = None,
        plan=None,
        model: str | None = None,
        want_model: bool = False,
        protocol: str = "json",
    ):
        # plan: `cleave serve --plan PLAN *flags` (flags name the runner) instead of BUNDLE.
        self.bundle, self.plan, self.flags, self.server = bundle, plan, flags or [], None
        self.url = url.rstrip("/") if url else ""
        # Every router's URL (a plan may have several; the first is `url`). The load of each
        # open-loop probe is split over them.
        self.urls: list[str] = [self.url] if self.url else []
        self._url_dir: Path | None = None  # where `cleave serve --url-file` writes them
        self.model = model  # the served model's name when it is not the workload's
        self.want_model = want_model  # --check against the float32 model, not the bundle
        self.protocol = protocol  # what its requests are: json, binary or grpc
        self.endpoints: dict[str, str] = {}  # role -> /metrics URL
        # --protocol grpc: the port `flags` gave the router, or with `--grpc-port 0` the one
        # it bound, read from its log at each start.
        self.grpc_port = self._grpc_flag = _grpc_port(self.flags)
        self.links: dict[str, tuple[str, str, str]] = {}  # testbed host -> its link
        self.cpus: list[int] | None = None  # the cores the deployment runs on (None: any)
        self.dense_dtype: str | None = None  # what its rankers serve, from their log
        self.owner: Target | None = None  # the deployment this one reaches another way

    def through(self, protocol: str) -> Target:
        """This deployment reached through `protocol` (its router serves every protocol): a
        target of its own in the report, without a deployment of its own to start."""
        other = Target(model=self.model, want_model=self.want_model, protocol=protocol)
        other.owner = self
        return other

    @property
    def running(self) -> bool:
        """Started here and not stopped (a deployment someone else runs never is)."""
        return self.owner.running if self.owner else self.server is not None

    @property
    def restartable(self) -> bool:
        if self.owner is not None:
            return self.owner.restartable
        return self.bundle is not None or self.plan is not None

    def start(self) -> Target:
        from cleave.bench.stages import metrics_endpoints, printed_all_metrics, testbed_links

        if self.owner is not None:
            owner = self.owner if self.owner.running else self.owner.start()
            for key in ("url", "urls", "grpc_port", "endpoints", "links", "dense_dtype"):
                setattr(self, key, getattr(owner, key))
            return self
        if self.restartable:
            from cleave.bench.machine import pinned
            from cleave.launch.process import ServeProcess

            where = [self.bundle] if self.plan is None else [None, "--plan", str(self.plan)]
            url_flags = []
            if self.plan is not None:  # written before its first "ready" line: read it then
                self._url_dir = Path(tempfile.mkdtemp(prefix="cleave-bench-urls-"))
                url_flags = ["--url-file", str(self._url_dir / "urls")]
            self.server = ServeProcess(*where, *self.flags, *url_flags)
            try:
                with pinned(self.cpus):  # every role started inherits them
                    self.server.start()
            except BaseException:  # SIGTERM while it starts, say: stop what has started
                self.stop()
                raise
            self.url = self.server.url
            self.urls = [self.url]
            if self._url_dir is not None:
                self.urls = [u.rstrip("/") for u in (self._url_dir / "urls").read_text().split()]
            # Its "metrics" lines (stderr) come before "ready" (stdout), but each stream has
            # its own reader: wait a little for them. Read now: the log keeps only its last lines.
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not printed_all_metrics(list(self.server.log)):
                time.sleep(0.02)
        log = list(self.server.log) if self.server else []
        if self._grpc_flag == 0 and self.server:
            self.grpc_port = int(bound_grpc_address(log).rsplit(":", 1)[1])
        self.endpoints = metrics_endpoints(log, self.url)
        self.links = testbed_links(log)
        self.dense_dtype = self._served_dtype()
        return self

    def _served_dtype(self) -> str | None:
        """What the first ranker's /metrics says it serves (every ranker serves the same)."""
        from cleave.launch.supervisor import probe_text
        from cleave.ranker.probes import served_dtype

        url = next((u for role, u in self.endpoints.items() if role.startswith("ranker-")), None)
        return served_dtype(probe_text(url)) if url else None

    def stop(self) -> None:
        if self.owner is not None:  # measured alone, as every deployment is
            self.owner.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._url_dir is not None:  # `cleave serve` removed the file as it stopped
            shutil.rmtree(self._url_dir, ignore_errors=True)
            self._url_dir = None

    def restart(self) -> None:
        if self.owner is not None:
            self.owner.restart()
        else:
            self.stop()
        self.start()

    def cpu_seconds(self, fine: bool = False) -> dict[str, float]:
        """CPU time so far (user + system) of each process of the deployment, by role; empty
        for a deployment started elsewhere. `fine`: from the live threads' schedstat (ns),
        for runs a few clock ticks long; it leaves out threads that ended."""
        from cleave.bench.harness.processes import cpu_ns, cpu_seconds, process_tree

        if self.owner is not None:
            return self.owner.cpu_seconds(fine)
        if self.server is None or self.server.proc is None:
            return {}
        used: dict[str, float] = {}
        for pid, role in process_tree(self.server.proc.pid).items():
            if fine:
                try:
                    seconds = cpu_ns(pid) / 1e9
                except OSError:  # gone meanwhile
                    seconds = None
            else:
                seconds = cpu_seconds(pid)
            if seconds is not None:
                used[role] = used.get(role, 0.0) + seconds
        return used

    def bodies(self, workload: Workload) -> list:
        """The workload's requests in this target's protocol."""
        return workload.bodies_for.get(self.protocol, workload.bodies)

    def infer_url(self, workload: Workload) -> str:
        model = self.model or workload.name
        if self.protocol == "grpc":  # the load generator's form for gRPC: grpc://HOST:PORT/MODEL
            return f"grpc://127.0.0.1:{self.grpc_port}/{model}"
        return f"{self.url}/v2/models/{model}/infer"

    def infer_urls(self, workload: Workload) -> list[str]:
        """Every router's infer URL (gRPC: the one port this command gave `cleave serve`)."""
        if self.protocol == "grpc" or len(self.urls) < 2:
            return [self.infer_url(workload)]
        model = self.model or workload.name
        return [f"{url}/v2/models/{model}/infer" for url in self.urls]

    def checker(self, workload: Workload):
        """What --check compares this deployment's responses with."""
        return functools.partial(workload.check, want_model=self.want_model, dtype=self.dense_dtype)

    def __enter__(self) -> Target:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def bound_grpc_address(log: list[str]) -> str:
    """`HOST:PORT` of a router's "listening http://ADDR grpc=ADDR" line in a deployment's
    log (the launcher forwards it before ready): where `--grpc-port 0` bound."""
    for line in log:
        if " listening http" in line and " grpc=" in line:
            return line.split(" grpc=", 1)[1].split()[0]
    raise RuntimeError("the deployment is up without having logged a gRPC address")


def _grpc_port(flags: list[str]) -> int | None:
    return int(flags[flags.index("--grpc-port") + 1]) if "--grpc-port" in flags else None


def serve_flags(args, mode: str, protocol: str = "json") -> list[str]:
    """`cleave serve`'s flags for a deployment in `mode` (disaggregated, monolithic,
    router-held) that gets requests in `protocol`. `--rankers` counts for the disaggregated
    deployments: the monolith is one process (docs/plan.md, "monolithic")."""
    rankers = 1 if mode == "monolithic" else args.rankers
    flags = ["--shards", str(args.shards), "--rankers", str(rankers)]
    if protocol == "grpc":
        flags += ["--grpc-port", "0"]  # the router binds one and logs it: no port to pick
    if args.config:
        flags += ["--config", args.config]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.compile:
        flags.append("--compile")
    if getattr(args, "device", None) and mode != "monolithic":  # the monolith is CPU-only
        flags += ["--device", args.device]
    if mode != "disaggregated":
        flags.append(f"--{mode}")
    return flags
