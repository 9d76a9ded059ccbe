"""The settings schema (python/cleave/settings): the files generated from it are current and
the check catches a stale one; every side takes its defaults and names from it (launcher argv,
the router's JSON, the ranker's flags); aliases work and warn; bad values are named.
The Rust sides compare themselves with the generated settings.json in `cargo test`
(cleave-router's config, cleave-wire's and cleave-flow's queue names)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cleave.errors import UsageError
from cleave.launch.supervisor import find_executable
from cleave.plan import local_plan, plan_from_dict, plan_to_dict
from cleave.ranker import cli as ranker_cli
from cleave.ranker.queues import POLICIES
from cleave.settings import (
    INCAST_ORDERS,
    QUEUE_POLICIES,
    IncastConfig,
    RankerConfig,
    RouterConfig,
    ServeConfig,
    ShardConfig,
    artifacts,
    config_file,
    flags,
)
from cleave.settings.router_json import LAUNCHER_ONLY, router_config

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = {
    "format": "cleave-bundle",
    "version": 1,
    "tables": [{"name": "t0", "rows": 100, "dim": 4, "dtype": "float32", "row_bytes": 16}],
}


@pytest.fixture
def bundle(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(MANIFEST))
    return path


def copy_tree(tmp_path: Path) -> Path:
    """The generated files (and what they are generated into) under a scratch root."""
    for rel in artifacts.expected(ROOT):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


# --- generated files ---------------------------------------------------------------------


def test_the_generated_files_are_current():
    stale = artifacts.stale()
    assert not stale, f"stale: {stale}; run `python -m cleave.settings --write`"
    done = subprocess.run(
        [sys.executable, "-m", "cleave.settings", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_check_names_an_edited_file_and_write_restores_it(tmp_path):
    root = copy_tree(tmp_path)
    helm = root / artifacts.HELM_SETTINGS
    values = json.loads(helm.read_text())
    values["router_json"]["ready_timeout_ms"] = 60000  # the drift this schema ended
    helm.write_text(json.dumps(values, indent=1) + "\n")
    doc = root / artifacts.SERVING_DOC
    doc.write_text(doc.read_text().replace("budget_ms = 1000.0", "budget_ms = 900.0"))
    assert artifacts.stale(root) == [artifacts.HELM_SETTINGS, artifacts.SERVING_DOC]
    assert artifacts.write(root) == [artifacts.HELM_SETTINGS, artifacts.SERVING_DOC]
    assert artifacts.stale(root) == []
    assert (root / artifacts.SERVING_DOC).read_text() == (ROOT / artifacts.SERVING_DOC).read_text()


def test_a_changed_default_makes_the_files_stale(tmp_path, monkeypatch):
    root = copy_tree(tmp_path)
    field = next(f for f in dataclasses.fields(RouterConfig) if f.name == "budget_ms")
    monkeypatch.setattr(field, "default", 900.0)
    assert artifacts.stale(root) == [artifacts.HELM_SETTINGS, artifacts.SERVING_DOC]
    artifacts.write(root)
    written = json.loads((root / artifacts.HELM_SETTINGS).read_text())
    assert written["router"]["budget_ms"] == written["router_json"]["budget_ms"] == 900.0
    assert "budget_ms = 900.0" in (root / artifacts.SERVING_DOC).read_text()


def test_lost_markers_are_an_error_naming_them(tmp_path):
    root = copy_tree(tmp_path)
    doc = root / artifacts.SERVING_DOC
    doc.write_text(doc.read_text().replace(artifacts.END, ""))
    with pytest.raises(ValueError, match="markers"):
        artifacts.stale(root)


# --- one source, every side ------------------------------------------------------------------


def test_the_ready_timeout_is_the_schemas_on_every_side():
    """Python wins the old 120 s / 60 s drift; Rust's default is checked in cargo test."""
    values = json.loads((ROOT / artifacts.HELM_SETTINGS).read_text())
    assert values["router_json"]["ready_timeout_ms"] == ServeConfig().ready_timeout_s * 1000
    assert values["router_json"]["ready_timeout_ms"] == 120_000


def test_every_router_setting_reaches_the_routers_json():
    """A new RouterConfig field is written to the router (whose parser refuses an unknown
    key: the Rust test parses the generated JSON) unless it is for the launchers only."""
    r = RouterConfig(response_credits=1 << 20, tls_cert="c", tls_key="k", auth_token_file="t")
    written = router_config("m", Path("b"), ServeConfig(router=r), [], ["a:1"])
    for f in dataclasses.fields(RouterConfig):
        if f.name in LAUNCHER_ONLY:
            assert f.name not in written
        elif f.name == "body_limit_mb":
            assert written["body_limit_bytes"] == 64 << 20
        else:
            assert f.name in written, f.name


def parse_ranker(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ranker_cli.add_arguments(parser)
    return parser.parse_args(["--bundle", "b", "--listen", "l", *argv])


def test_ranker_flags_defaults_are_the_schemas():
    args = parse_ranker([])
    for cls in (RankerConfig, IncastConfig):
        for f in dataclasses.fields(cls):
            if f.name in ("threads", "cuda_graphs", "compile_cache", "shared_batching"):
                continue  # flags without a value: None or a switch
            assert getattr(args, f.name) == f.default, f.name


def test_launcher_flags_round_trip_through_the_rankers_parser():
    """What the runners write for a plan's ranker is what the ranker reads back."""
    ranker = RankerConfig(
        device="cpu",
        dense_dtype="int8",
        threads=3,
        max_batch=7,
        max_wait_ms=1.5,
        max_queue=9,
        queue="edf",
        cuda_graphs=False,
        compile=True,
        compile_cache="/c",
        shared_batching=False,
    )
    incast = IncastConfig(
        incast_window_bytes=5, incast_adaptive=True, incast_order="fifo", link_gbit=2.5
    )
    args = parse_ranker([*flags(ranker, RankerConfig), *flags(incast, IncastConfig)])
    assert (args.device, args.threads, args.max_batch, args.max_wait_ms) == ("cpu", 3, 7, 1.5)
    assert args.dense_dtype == "int8"
    assert (args.max_queue, args.queue, args.compile, args.compile_cache) == (9, "edf", True, "/c")
    assert args.no_cuda_graphs and args.no_shared_batching
    assert (args.incast_window_bytes, args.incast_adaptive) == (5, True)
    assert (args.incast_order, args.link_gbit) == ("fifo", 2.5)
    # Off and automatic values are left out; so is every switch at its default.
    assert flags(RankerConfig(threads=0, max_wait_ms=0.0), RankerConfig) == [
        *("--device", "auto", "--dense-dtype", "auto", "--max-batch", "256"),
        *("--max-queue", "1024", "--queue", "fifo"),
    ]
    assert flags(ShardConfig(), ShardConfig) == ["--threads", "1", "--queue", "fifo"]


def test_plan_roles_take_their_defaults_from_the_schema(bundle):
    plan = local_plan(bundle, ServeConfig())
    data = plan_to_dict(plan)
    for role in (*data["shards"], *data["rankers"]):
        for key in ("queue", "dram_budget", "compile", "incast_order", "link_gbit"):
            role.pop(key, None)
    again = plan_from_dict(data, "plan.yaml")
    assert again.shards[0].queue == ShardConfig().queue
    assert again.rankers[0].incast_order == IncastConfig().incast_order
    assert again.rankers[0].link_gbit == IncastConfig().link_gbit


def test_enumerations_are_one_list_each():
    assert sorted(POLICIES) == sorted(QUEUE_POLICIES.names)
    values = json.loads((ROOT / artifacts.HELM_SETTINGS).read_text())
    assert values["choices"]["queue_policy"]["names"] == list(QUEUE_POLICIES.names)
    assert values["choices"]["incast_order"]["aliases"] == {"fcfs": "fifo"}


def test_the_incast_queue_takes_every_incast_order_and_the_alias():
    from cleave._native import IncastScheduler

    for name in (*INCAST_ORDERS.names, *INCAST_ORDERS.aliases):
        IncastScheduler(1 << 20, name, 1e9, True)
    with pytest.raises(ValueError, match='expected one of fifo, edf, got "random"'):
        IncastScheduler(1 << 20, "random", 1e9, True)


# --- aliases and bad values ------------------------------------------------------------------


def test_fcfs_is_fifo_with_a_warning_in_a_config_file(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[shard]\nqueue = "fcfs"\n[ranker]\nqueue = "fifo"\n')
    with pytest.warns(FutureWarning, match=r"shard\.queue: 'fcfs' is deprecated, use 'fifo'"):
        config = config_file.load(path)
    assert (config.shard.queue, config.ranker.queue) == ("fifo", "fifo")
    config.check()


def test_fcfs_is_fifo_with_a_warning_in_a_plan(bundle):
    data = plan_to_dict(local_plan(bundle, ServeConfig()))
    data["rankers"][0]["incast_order"] = "fcfs"
    with pytest.warns(FutureWarning, match="incast_order: 'fcfs' is deprecated, use 'fifo'"):
        plan = plan_from_dict(data, "plan.yaml")
    assert plan.rankers[0].incast_order == "fifo"
    plan.check(MANIFEST)


def test_fcfs_is_fifo_with_a_warning_on_the_command_lines():
    with pytest.warns(FutureWarning, match="--incast-order: 'fcfs' is deprecated"):
        assert parse_ranker(["--incast-order", "fcfs"]).incast_order == "fifo"
    with pytest.warns(FutureWarning, match="--queue: 'fcfs' is deprecated"):
        assert parse_ranker(["--queue", "fcfs"]).queue == "fifo"
    shard = find_executable("cleave-shard")
    # No bundle: it stops after parsing its flags, the warning already written.
    done = subprocess.run([shard, "--queue", "fcfs"], capture_output=True, text=True, timeout=60)
    assert 'warning: --queue "fcfs" is deprecated, use "fifo"' in done.stderr, done.stderr


def test_an_unknown_name_is_refused_naming_the_key_and_the_list(tmp_path, bundle):
    path = tmp_path / "serve.toml"
    path.write_text('[ranker]\nqueue = "random"\n')
    with pytest.raises(UsageError, match=f"ranker.queue: expected {QUEUE_POLICIES.expected()}"):
        config_file.load(path).check()
    data = plan_to_dict(local_plan(bundle, ServeConfig()))
    data["rankers"][0]["incast_order"] = "random"
    data["transport"] = "carrier-pigeon"
    with pytest.raises(UsageError) as err:
        plan_from_dict(data, "plan.yaml").check(MANIFEST)
    assert 'rankers[0].incast_order: expected "fifo" or "edf", got \'random\'' in str(err.value)
    expected = 'transport: expected "unix", "shm", "tcp" or "mptcp", got \'carrier-pigeon\''
    assert expected in str(err.value)
    shard = find_executable("cleave-shard")
    done = subprocess.run([shard, "--queue", "random"], capture_output=True, text=True, timeout=60)
    names = ", ".join(f'"{n}"' for n in QUEUE_POLICIES.names)
    assert done.returncode == 2 and f"expected one of {names}" in done.stderr, done.stderr


def test_a_bad_admission_rule_is_refused_by_the_launcher_and_the_router(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[router]\nadmission = "lifo"\n')
    with pytest.raises(
        UsageError, match='router.admission: expected "adaptive" or "estimate", got \'lifo\''
    ):
        config_file.load(path).check()
    config = {"model": "m", "bundle": "b", "rankers": ["a:1"], "admission": "lifo"}
    bad = tmp_path / "router.json"
    bad.write_text(json.dumps(config))
    router = find_executable("cleave-router")
    done = subprocess.run([router, str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stderr
    assert "unknown variant `lifo`, expected `adaptive` or `estimate`" in done.stderr, done.stderr
