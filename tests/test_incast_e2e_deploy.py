"""Incast control in the deployment (docs/traffic.md): a plan with `incast_control` on gives
each ranker a control port (the flag on its command line) and every router the ranker's
control address; the Helm chart renders a second container and Service port `control`, the
ranker's flags and the router JSON's `ranker_control`, and renders none of it when off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cleave.plan import load_plan, save_plan
from cleave.runners.local import LocalBinding
from cleave.runners.roles import RoleSpecs
from support.helm import make_plan, template
from support.shards import write_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("incast-deploy") / "model"
    write_bundle(path)
    return path


@pytest.fixture(scope="module")
def incast_plan(bundle):
    path = make_plan(bundle, bundle.parent / "incast.yaml", "--hosts", "2")
    plan = load_plan(path)
    plan.incast_control = True
    plan.incast_threshold_bytes = 4096
    plan.rankers[0].control_port = 7200
    plan.rankers[0].incast_window_bytes = 2 << 20
    plan.rankers[0].incast_adaptive = True
    return save_plan(plan, path)


def test_local_runner_passes_the_control_port_to_ranker_and_router(incast_plan, tmp_path):
    plan = load_plan(incast_plan)
    specs = RoleSpecs(plan, LocalBinding(plan, tmp_path, "127.0.0.1"), tmp_path)
    (ranker,) = specs.ranker_specs()
    argv = ranker.argv
    port = argv[argv.index("--control-port") + 1]
    assert argv[argv.index("--incast-window-bytes") + 1] == str(2 << 20)
    assert "--incast-adaptive" in argv
    (router,) = specs.router_specs(specs.shard_specs(), [ranker])
    config = json.loads(specs.config_path(router.name).read_text())
    assert config["incast_control"] is True and config["incast_threshold_bytes"] == 4096
    assert config["ranker_control"] == {ranker.address: f"127.0.0.1:{port}"}


def test_the_chart_exposes_the_control_port_only_when_on(helm, incast_plan, bundle):
    done = template(helm, incast_plan)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    ranker = next(
        d for d in docs if d["kind"] == "StatefulSet" and "ranker" in d["metadata"]["name"]
    )
    container = ranker["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "control", "containerPort": 7200} in container["ports"]
    assert "--control-port=7200" in container["args"]
    assert "--incast-window-bytes=2097152" in container["args"]
    assert "--incast-adaptive" in container["args"]
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-ranker")
    )
    assert any(p["name"] == "control" for p in service["spec"]["ports"])
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and "router.json" in d.get("data", {})
    )
    router = json.loads(config["data"]["router.json"])
    assert router["incast_control"] is True and router["incast_threshold_bytes"] == 4096
    ((data, control),) = router["ranker_control"].items()
    assert data in router["rankers"] and control.endswith(":7200")

    off = template(helm, make_plan(bundle, bundle.parent / "off.yaml", "--hosts", "2"))
    assert off.returncode == 0, off.stderr
    assert "--control-port" not in off.stdout and "ranker_control" not in off.stdout
    assert "name: control" not in off.stdout
