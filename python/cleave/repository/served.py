"""What a repository deployment serves, and the processes behind it (docs/repository.md): each
model version's rankers, and the shards of the tables no served version had before. A table
whose key (bundle.repository.TableKey) a served version already has is looked up where it
already is, so a version that changes only its dense weights starts rankers and no shard.

`stage` starts a version's processes and returns the router's entry for it; `release` stops
what no remaining version uses. Either leaves nothing behind when it fails. Which roles a
version gets, and where, is its placement's (placement.py); how they are bound, the hosts'
(hosts.py): one of each per runner."""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.bundle.repository import TableKey, table_keys
from cleave.errors import CleaveError
from cleave.launch.supervisor import ChildFailed, Supervisor
from cleave.plan import this_machine
from cleave.plan.check import SHARD_MARGIN_BYTES
from cleave.plan.repository import cut
from cleave.runners.roles import RoleSpecs, activation_bytes
from cleave.runners.supervised import start_backends
from cleave.settings import ServeConfig

GIB = 1 << 30


class LoadError(CleaveError):
    """A version that cannot be loaded; `status` is the HTTP status the API answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Version:
    model: str
    version: int
    bundle: Path
    keys: dict[str, TableKey]  # its tables
    children: list[str]  # the processes started for it: rankers, shards of its new tables
    entry: dict  # the router's configuration of it (crates/cleave-router, config.rs)


@dataclass
class TableHome:
    """Where a table's rows are served: routes to the shards that hold them."""

    routes: list[dict]
    shards: set[str]
    users: set[tuple[str, int]] = field(default_factory=set)


class Served:
    """The versions served, their tables and their processes. Calls are serialised."""

    def __init__(
        self, config: ServeConfig, supervisor: Supervisor, runtime: Path, placement, hosts
    ):
        self.config = config
        self.supervisor = supervisor
        self.runtime = runtime
        self.placement = placement  # a version's roles (placement.py)
        self.hosts = hosts  # their bindings (hosts.py)
        self.versions: dict[tuple[str, int], Version] = {}
        self.homes: dict[TableKey, TableHome] = {}
        self.shard_bytes: dict[str, int] = {}  # a shard's memory: rows, within its DRAM budget
        # The largest memory per batch row any ranker measured (an adaptive cache's figure).
        self.activation_bytes = 0
        self.lock = threading.Lock()
        budget = config.table_memory_budget
        self.memory_budget = budget or int(this_machine("h0").memory_gib * GIB)

    def stage(self, model: str, version: int, bundle: Path) -> dict:
        """Starts the version's processes, waits until they are ready (its rankers check the
        dense program on the bundle's probe batch first), and returns its router entry."""
        with self.lock:
            if (model, version) in self.versions:
                return self.versions[(model, version)].entry
            self.supervisor.say(f"{model} version {version}: loading {bundle}")
            manifest = manifest_io.read(bundle)  # BundleError, naming the file, if corrupt
            keys = table_keys(bundle, manifest)
            self._set_apart_updated(keys)
            plan = self._plan(model, version, bundle, keys)
            self._check_memory(model, version, plan, manifest)
            names = [r.name for r in [*plan.shards, *plan.rankers]]
            timeout = self.config.ready_timeout_s
            try:
                specs = RoleSpecs(plan, self.hosts.bind(plan), self.runtime)
                shards, rankers = start_backends(self.supervisor, specs, timeout)
            except (ChildFailed, CleaveError) as err:
                self.supervisor.retire(set(names), self.config.stop_timeout_s)
                self.hosts.free(set(names))
                raise LoadError(f"{model} version {version} did not start: {err}") from None
            address = {spec.name: spec.address for spec in shards}
            self.activation_bytes = max(self.activation_bytes, activation_bytes(rankers))
            new_homes = {}
            for shard in plan.shards:
                for table, (a, b) in shard.ranges.items():
                    home = new_homes.setdefault(keys[table], TableHome([], set()))
                    home.routes.append(
                        {"table": table, "row_start": a, "row_end": b, "addr": address[shard.name]}
                    )
                    home.shards.add(shard.name)
                self.shard_bytes[shard.name] = _shard_bytes(shard, manifest)
            self.homes.update(new_homes)
            routes = []
            for key in keys.values():
                self.homes[key].users.add((model, version))
                routes += self.homes[key].routes
            entry = {
                "model": model,
                "version": str(version),
                "bundle": str(bundle),
                "shards": routes,
                "rankers": [spec.address for spec in rankers],
            }
            self.versions[(model, version)] = Version(model, version, bundle, keys, names, entry)
            shared = sorted(set(keys) - {t for s in plan.shards for t in s.ranges})
            self.supervisor.say(
                f"{model} version {version}: {len(rankers)} rankers, {len(shards)} new shards; "
                f"tables served already: {', '.join(shared) or 'none'}"
            )
            for spec in [*shards, *rankers]:
                self.supervisor.say(f"metrics {spec.name} {spec.probe}/metrics")
            return entry

    def entries(self) -> list[dict]:
        """The router's entry of every version served, by model and version."""
        with self.lock:
            return [self.versions[key].entry for key in sorted(self.versions)]

    def release(self, model: str, version: int) -> None:
        """Stops the version's rankers and the shards that no other served version uses."""
        with self.lock:
            served = self.versions.pop((model, version), None)
            if served is None:
                return
            stop = set(served.children) - {s for h in self.homes.values() for s in h.shards}
            for key in served.keys.values():
                home = self.homes[key]
                home.users.discard((model, version))
                if not home.users:
                    stop |= home.shards
                    del self.homes[key]
            # A shard holding several tables stops only when none of them is used any more.
            stop -= {s for h in self.homes.values() for s in h.shards}
            for name in stop:
                self.shard_bytes.pop(name, None)
            self.supervisor.retire(stop, self.config.stop_timeout_s)
            self.hosts.free(stop)
            for name in stop:
                shutil.rmtree(self._state_dir(name), ignore_errors=True)

    def _state_dir(self, shard: str) -> Path:
        """Where a shard keeps the versions `cleave update` and `cleave stream` give its tables
        (docs/tiers.md, "Updates"): they survive the shard's restarts, not the deployment's."""
        return self.runtime / "state" / shard

    def _set_apart_updated(self, keys: dict[str, TableKey]) -> None:
        """A served table that took row updates no longer holds its bundle's bytes, so a
        version loading a table with that key gets a copy of its own: its home is re-keyed,
        and the versions using it keep it."""
        shared = {name: self.homes[key] for name, key in keys.items() if key in self.homes}
        for name in _updated(shared):
            key, home = keys[name], shared[name]
            apart = dataclasses.replace(key, sha256=f"{key.sha256}+updated-{secrets.token_hex(4)}")
            self.homes[apart] = self.homes.pop(key)
            for user in home.users:
                used = self.versions[user].keys
                for table, k in used.items():
                    if k == key:
                        used[table] = apart

    def _plan(self, model: str, version: int, bundle: Path, keys: dict[str, TableKey]):
        """The version's roles as its placement gives them, its shards cut down to the tables
        not served yet, each with a state directory of its own."""
        plan = self.placement.roles(model, version, bundle)
        new = {name for name, key in keys.items() if key not in self.homes}
        plan = cut(plan, new)
        live = {name for home in self.homes.values() for name in home.shards}
        for shard in plan.shards:
            if shard.name in live:
                # A version loaded again while its old shards still serve tables that others
                # share: the new one needs a name (and, on a host, ports) of its own.
                n = 1
                while f"{shard.name}-{n}" in live:
                    n += 1
                shard.name, shard.port, shard.metrics_port = f"{shard.name}-{n}", 0, 0
            state = self._state_dir(shard.name)
            shutil.rmtree(state, ignore_errors=True)  # a reloaded version starts as its bundle
            state.mkdir(parents=True)
            shard.state_dir = str(state)
        # A plan written for other versions may leave a table to one that is not served (it
        # could not be loaded): nothing would look its rows up.
        unheld = sorted(new - {t for s in plan.shards for t in s.ranges})
        if unheld:
            raise LoadError(
                f"{model} version {version}: no shard of its placement holds tables "
                f"{', '.join(unheld)}, and no served version has them (the plan gives them to "
                "a version that is not served); load that version first, or plan again"
            )
        return plan

    def _check_memory(self, model: str, version: int, plan, manifest: dict) -> None:
        """Refuses a version whose new tables do not fit beside the served ones."""
        held = sum(b + SHARD_MARGIN_BYTES for b in self.shard_bytes.values())
        need = sum(_shard_bytes(s, manifest) + SHARD_MARGIN_BYTES for s in plan.shards)
        if held + need > self.memory_budget:
            raise LoadError(
                f"{model} version {version} does not fit: its new tables need "
                f"{need / GIB:.3f} GiB (rows plus {SHARD_MARGIN_BYTES >> 20} MiB a shard), the "
                f"served versions hold {held / GIB:.3f} GiB, and the budget is "
                f"{self.memory_budget / GIB:.3f} GiB (table_memory_budget, or this machine's "
                "memory); unload a version or raise the budget"
            )


def _updated(shared: dict[str, TableHome]) -> set[str]:
    """Which of these tables (name: where it is served) their shards serve at a version other
    than the bundle's (0); each shard is asked once, over one client, for all of them."""
    from cleave.shard_update import UpdateError, tables_status

    by_shard: dict[str, list[str]] = {}
    for table, home in shared.items():
        addr = next(r["addr"] for r in home.routes if r["table"] == table)
        by_shard.setdefault(addr, []).append(table)
    updated = set()
    for addr, tables in by_shard.items():
        try:
            status = tables_status(addr, tables)
        except UpdateError as err:
            raise LoadError(
                f"cannot tell whether tables {', '.join(tables)} took row updates (their shard "
                f"{addr}: {err}); load again once the shard serves",
                status=503,
            ) from None
        updated |= {t for t, s in status.items() if int(s.get("version") or 0) > 0}
    return updated


def _shard_bytes(shard, manifest: dict) -> int:
    """The memory a shard's ranges take: their rows, or at most its DRAM budget (the rest is
    read from SSD, docs/tiers.md)."""
    row_bytes = {t["name"]: int(t["row_bytes"]) for t in manifest["tables"]}
    rows = sum((b - a) * row_bytes[t] for t, (a, b) in shard.ranges.items())
    return min(rows, shard.dram_budget) if shard.dram_budget else rows
