"""The Helm chart deploy/helm/cleave (docs/deploy.md), checked offline: no cluster here.
`helm lint`; `helm template` with the default values and with a 3 shards x 2 replicas,
2 rankers values file, each from a plan `cleave plan` makes in the test; every rendered
manifest validated against a pinned Kubernetes version's schemas (kubernetes-validate ships
them); the shard StatefulSet, the ConfigMap and the router JSON agree with the plan (replica
count, each ordinal's ranges, ports, resources, GPUs, router_config's keys); a real
cleave-shard takes its rows from the rendered plan by its index; the rankers' membership
sidecar admits and removes an extra ranker of a real deployment; bad values fail the render,
saying what to change. helm is built into .tools/bin by `make tools` (test-python depends on it)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cleave.launch.process import ServeProcess
from cleave.launch.supervisor import find_executable
from cleave.plan import load_plan
from cleave.runners import membership
from cleave.settings import ServeConfig
from cleave.settings.router_json import router_config
from support.helm import (
    CHART,
    KUBERNETES,
    MEMBERS,
    NAMESPACE,
    RELEASE,
    make_plan,
    run_helm,
    template,
)
from support.processes import Process, cli
from support.served import Served, check_scores
from support.shards import write_bundle
from support.waiting import wait_for

START_S = 60.0  # a bound on a shard's start-up, never a timing assertion


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("helm") / "model"
    write_bundle(path)
    return path


@pytest.fixture(scope="module")
def small_plan(bundle: Path) -> Path:
    return make_plan(bundle, bundle.parent / "small.yaml", "--hosts", "2")


@pytest.fixture(scope="module")
def big_plan(bundle: Path) -> Path:
    """3 range groups x 2 replicas and 2 rankers on 4 hosts (the testbed layout)."""
    return make_plan(
        bundle,
        bundle.parent / "big.yaml",
        *("--hosts", "4", "--shards", "3", "--replicas", "2", "--rankers", "2"),
    )


@pytest.fixture(scope="module")
def big_values(bundle: Path) -> Path:
    """What a user of the 3 x 2 plan might set: ranker autoscaling on its queue depth."""
    path = bundle.parent / "values-3x2.yaml"
    values = {
        "images": {"shard": {"repository": "registry.example/cleave-shard", "tag": "1"}},
        "ranker": {
            "autoscaling": {
                "enabled": True,
                "maxReplicas": 6,
                "metric": "cleave_ranker_queue_depth",
            }
        },
        "router": {"autoscaling": {"maxReplicas": 3}},
    }
    path.write_text(yaml.safe_dump(values))
    return path


def rendered(helm: Path, plan: Path, *args: str) -> dict[tuple[str, str], dict]:
    done = template(helm, plan, *args)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint(helm, small_plan):
    done = run_helm(
        helm, "lint", str(CHART), "--kube-version", KUBERNETES, "--set-file", f"plan={small_plan}"
    )
    assert done.returncode == 0, done.stdout + done.stderr


FETCH = (
    *("--set", "bundle.pvc=", "--set", "bundle.fetch.image=registry.example/fetch:1"),
    *("--set", "bundle.fetch.command={sh,-c,cp -r /src/. $BUNDLE_DIR}"),
)


@pytest.fixture(scope="module")
def secure_plan(small_plan: Path) -> Path:
    """The small plan with gRPC, an internal secret and EDF queues."""
    text = yaml.safe_load(small_plan.read_text())
    for router in text["routers"]:
        router["grpc_port"] = 8001
    text["router"]["internal_secret_env"] = "CLEAVE_SECRET"
    for role in [*text["shards"], *text["rankers"]]:
        role["queue"] = "edf"
    path = small_plan.with_name("secure.yaml")
    path.write_text(yaml.safe_dump(text))
    return path


SECURE = (
    *("--set", "router.tlsSecret=cleave-tls", "--set", "router.authTokenSecret.name=cleave-tokens"),
    *("--set", "internalSecret.name=cleave-internal"),
)


@pytest.mark.parametrize("case", ["default", "3x2", "fetch", "secure"])
def test_rendered_manifests_are_valid_kubernetes(
    helm, small_plan, big_plan, big_values, secure_plan, case
):
    if case == "default":
        docs = rendered(helm, small_plan)
    elif case == "secure":
        docs = rendered(helm, secure_plan, *SECURE)
    elif case == "3x2":
        docs = rendered(helm, big_plan, "--values", str(big_values))
    else:  # the bundle fetched by an init container into an emptyDir
        docs = rendered(helm, small_plan, *FETCH)
        pod = docs[("StatefulSet", f"{RELEASE}-shard")]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == ["sh", "-c", "cp -r /src/. $BUNDLE_DIR"]
        assert pod["volumes"][0] == {"name": "bundle", "emptyDir": {"sizeLimit": "20Gi"}}
    kinds = sorted(kind for kind, _ in docs)
    for kind in ("ConfigMap", "Deployment", "HorizontalPodAutoscaler", "StatefulSet"):
        assert kind in kinds, kinds
    assert kinds.count("PodDisruptionBudget") == 3
    for (kind, name), doc in docs.items():
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind} {name} is not valid Kubernetes {KUBERNETES}: {err}")


def memory_share_mi(plan, kind: str) -> int:
    """The chart's rule: the smallest (host memory / roles on that host) among the hosts
    running roles of this kind, in MiB."""
    roles = [*plan.shards, *plan.rankers, *plan.routers]
    hosts = {h.name: h for h in plan.hosts}
    shares = []
    for role in getattr(plan, kind):
        on_host = sum(1 for r in roles if r.host == role.host)
        shares.append(math.floor(hosts[role.host].memory_gib * 1024 / on_host))
    return min(shares)


def test_shard_statefulset_and_configmap_agree_with_the_plan(helm, big_plan, big_values):
    plan = load_plan(big_plan)
    assert (len(plan.shards), len({s.group for s in plan.shards})) == (6, 3)
    docs = rendered(helm, big_plan, "--values", str(big_values))
    config = docs[("ConfigMap", f"{RELEASE}-config")]["data"]

    rendered_plan = json.loads(config["plan.json"])
    assert rendered_plan == yaml.safe_load(big_plan.read_text())  # the plan as the user wrote it
    for i, shard in enumerate(plan.shards):  # ordinal i is shards[i], ranges and all
        entry = rendered_plan["shards"][i]
        assert entry["name"] == shard.name
        assert {t: tuple(r) for t, r in entry["ranges"].items()} == dict(shard.ranges)

    sts = docs[("StatefulSet", f"{RELEASE}-shard")]
    assert sts["spec"]["replicas"] == len(plan.shards)
    assert sts["spec"]["serviceName"] == f"{RELEASE}-shard"
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/cleave-shard:1"
    assert "--shard-index=$(POD_INDEX)" in container["args"]
    assert "--plan=/etc/cleave/plan.json" in container["args"]
    (env,) = container["env"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"lookup": 7000, "metrics": 9000}
    assert "--listen=0.0.0.0:7000" in container["args"]
    assert "--metrics-port=9000" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    memory = f"{memory_share_mi(plan, 'shards')}Mi"
    assert container["resources"] == {
        "requests": {"cpu": str(max(s.threads for s in plan.shards)), "memory": memory},
        "limits": {"memory": memory},
    }

    # The routers reach ordinal i at its stable DNS name, holding shards[i]'s ranges.
    router = json.loads(config["router.json"])
    want = [
        {
            "table": t,
            "row_start": a,
            "row_end": b,
            "addr": f"{RELEASE}-shard-{i}.{RELEASE}-shard.{NAMESPACE}.svc:7000",
        }
        for i, shard in enumerate(plan.shards)
        for t, (a, b) in sorted(shard.ranges.items())
    ]
    assert router["shards"] == want
    assert router["rankers"] == [
        f"{RELEASE}-ranker-{i}.{RELEASE}-ranker.{NAMESPACE}.svc:7100" for i in range(2)
    ]
    assert docs[("HorizontalPodAutoscaler", f"{RELEASE}-ranker")]["spec"]["minReplicas"] == 2
    ranker_pod = docs[("StatefulSet", f"{RELEASE}-ranker")]["spec"]["template"]["spec"]
    memory = f"{memory_share_mi(plan, 'rankers')}Mi"
    assert ranker_pod["containers"][0]["resources"] == {  # device auto, no GPU host: no GPU
        "requests": {"cpu": str(max(r.threads for r in plan.rankers)), "memory": memory},
        "limits": {"memory": memory},
    }
    assert "replicas" not in docs[("StatefulSet", f"{RELEASE}-ranker")]["spec"]  # the HPA's


@pytest.mark.parametrize("section", ["full", "partial"])
def test_router_json_has_router_configs_keys_and_the_plans_settings(
    helm, big_plan, tmp_path, section
):
    if section == "partial":  # a plan written before most router keys existed: their defaults
        text = yaml.safe_load(big_plan.read_text())
        text["router"] = {"budget_ms": 250.0, "shed": False}
        big_plan = tmp_path / "partial.yaml"
        big_plan.write_text(yaml.safe_dump(text))
    plan = load_plan(big_plan)
    config = ServeConfig(
        name=plan.name,
        host="0.0.0.0",
        http_port=8000,
        ready_timeout_s=plan.supervision.ready_timeout_s,
        router=plan.router,
    )
    want = router_config(plan.name, Path("/bundle"), config, [], [])
    docs = rendered(helm, big_plan)
    got = json.loads(docs[("ConfigMap", f"{RELEASE}-config")]["data"]["router.json"])
    assert sorted(got) == sorted(want)
    for key in set(want) - {"shards", "rankers"}:
        assert got[key] == want[key], key


def test_the_admin_token_comes_from_the_named_secret(helm, small_plan, tmp_path):
    text = yaml.safe_load(small_plan.read_text())
    text["router"]["admin_token_env"] = "CLEAVE_ADMIN_TOKEN"
    plan = tmp_path / "token.yaml"
    plan.write_text(yaml.safe_dump(text))
    docs = rendered(helm, plan, "--set", "router.adminTokenSecret.name=cleave-admin")
    pod = docs[("Deployment", f"{RELEASE}-router")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    from_secret = {
        "name": "CLEAVE_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "cleave-admin", "key": "token"}},
    }
    assert containers["router"]["env"] == [from_secret]
    sidecar_env = containers["members"]["env"]  # the sidecar calls the admin API too
    assert from_secret in sidecar_env
    assert {"name": "ADMIN_TOKEN_ENV", "value": "CLEAVE_ADMIN_TOKEN"} in sidecar_env
    config = json.loads(docs[("ConfigMap", f"{RELEASE}-config")]["data"]["router.json"])
    assert config["admin_token_env"] == "CLEAVE_ADMIN_TOKEN"  # the name only, never the token


def test_grpc_tls_tokens_internal_secret_and_queues_come_from_the_plan_and_values(
    helm, secure_plan
):
    docs = rendered(helm, secure_plan, *SECURE)
    config = json.loads(docs[("ConfigMap", f"{RELEASE}-config")]["data"]["router.json"])
    assert config["grpc_port"] == 8001
    assert (config["tls_cert"], config["tls_key"]) == (
        "/etc/cleave-tls/tls.crt",
        "/etc/cleave-tls/tls.key",
    )
    assert config["auth_token_file"] == "/etc/cleave-auth/tokens"
    service = docs[("Service", f"{RELEASE}-router")]["spec"]["ports"]
    assert {"name": "grpc", "port": 8001, "targetPort": "grpc"} in service
    pod = docs[("Deployment", f"{RELEASE}-router")]["spec"]["template"]["spec"]
    router = next(c for c in pod["containers"] if c["name"] == "router")
    assert {"name": "grpc", "containerPort": 8001} in router["ports"]
    assert router["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    assert (mounts["tls"], mounts["auth"]) == ("/etc/cleave-tls", "/etc/cleave-auth")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "cleave-tls"}
    assert volumes["auth"]["secret"] == {"secretName": "cleave-tokens"}
    secret = {
        "name": "CLEAVE_INTERNAL_SECRET",
        "valueFrom": {"secretKeyRef": {"name": "cleave-internal", "key": "secret"}},
    }
    for kind, role in (
        ("Deployment", "router"),
        ("StatefulSet", "shard"),
        ("StatefulSet", "ranker"),
    ):
        spec = docs[(kind, f"{RELEASE}-{role}")]["spec"]["template"]["spec"]
        container = next(c for c in spec["containers"] if c["name"] == role)
        assert secret in container["env"], role
        if role != "router":
            assert "--queue=edf" in container["args"], role
    # Without them, none of it: no gRPC port, no secret, plain probes, FIFO.
    plain = rendered(helm, secure_plan.with_name("small.yaml"))
    config = json.loads(plain[("ConfigMap", f"{RELEASE}-config")]["data"]["router.json"])
    assert not {"grpc_port", "tls_cert", "tls_key", "auth_token_file"} & set(config)
    pod = plain[("Deployment", f"{RELEASE}-router")]["spec"]["template"]["spec"]
    assert "scheme" not in pod["containers"][0]["readinessProbe"]["httpGet"]
    shard = plain[("StatefulSet", f"{RELEASE}-shard")]["spec"]["template"]["spec"]["containers"][0]
    assert "--queue=fifo" in shard["args"]
    assert all(e["name"] != "CLEAVE_INTERNAL_SECRET" for e in shard["env"])


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
def test_rankers_on_gpu_hosts_get_a_gpu_unless_on_cpu(helm, big_plan, tmp_path, device):
    text = yaml.safe_load(big_plan.read_text())
    for host in text["hosts"]:
        host["gpus"] = 1 if host["name"] == "h3" else 0  # h3 holds both rankers
    for ranker in text["rankers"]:
        ranker["device"] = device
    plan = tmp_path / "gpu.yaml"
    plan.write_text(yaml.safe_dump(text))
    docs = rendered(helm, plan)
    (ranker,) = docs[("StatefulSet", f"{RELEASE}-ranker")]["spec"]["template"]["spec"]["containers"]
    assert f"--device={device}" in ranker["args"]
    limits = ranker["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == (None if device == "cpu" else 1)
    (shard,) = docs[("StatefulSet", f"{RELEASE}-shard")]["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in shard["resources"]["limits"]


def load_members():
    """The chart's sidecar script (deploy/helm/cleave/files/members.py) as a module."""
    spec = importlib.util.spec_from_file_location("cleave_chart_members", MEMBERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_members_reconcile_adds_new_pods_and_removes_gone_ones_never_planned_ones():
    m = load_members()
    fmt, port = "r-{i}.r.ns.svc", 7100
    exists = {"r-2.r.ns.svc", "r-3.r.ns.svc"}.__contains__
    want = m.wanted(fmt, port, 2, 5, exists)
    assert want == {"r-2.r.ns.svc:7100", "r-3.r.ns.svc:7100"}
    mine = m.managed(fmt, port, 2, 5)
    assert "r-0.r.ns.svc:7100" not in mine and "r-4.r.ns.svc:7100" in mine
    current = {"r-0.r.ns.svc:7100", "r-1.r.ns.svc:7100", "r-3.r.ns.svc:7100", "r-4.r.ns.svc:7100"}
    assert m.reconcile(current, want, mine) == (["r-2.r.ns.svc:7100"], ["r-4.r.ns.svc:7100"])


def test_members_sidecar_admits_a_ranker_beyond_the_plan_and_removes_it(helm, big_plan, tmp_path):
    """The chart renders the sidecar with ranker autoscaling on; the script, run against a real
    deployment of one ranker, admits a second ranker process (ordinal 1 of RANKER_HOST) and
    requests are served exactly; once the ordinal's name no longer resolves it is drained and
    removed, and the plan's ranker stays."""
    docs = rendered(helm, big_plan)  # ranker autoscaling is on by default
    router_pod = docs[("Deployment", f"{RELEASE}-router")]["spec"]["template"]["spec"]
    sidecar = {c["name"]: c for c in router_pod["containers"]}["members"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["RANKER_HOST"] == f"{RELEASE}-ranker-{{i}}.{RELEASE}-ranker.{NAMESPACE}.svc"
    assert (env["PLANNED"], env["MAX_RANKERS"]) == ("2", "8")
    config = docs[("ConfigMap", f"{RELEASE}-config")]["data"]
    assert config["members.py"] == MEMBERS.read_text()
    fixed = rendered(helm, big_plan, "--set", "ranker.autoscaling.enabled=false")
    router_pod = fixed[("Deployment", f"{RELEASE}-router")]["spec"]["template"]["spec"]
    assert [c["name"] for c in router_pod["containers"]] == ["router"]
    assert fixed[("StatefulSet", f"{RELEASE}-ranker")]["spec"]["replicas"] == 2
    assert ("HorizontalPodAutoscaler", f"{RELEASE}-ranker") not in fixed

    served = Served("shared", tmp_path)
    with ServeProcess(served.dir, "--rankers", "1", "--transport", "tcp", "--http-port", "0") as s:
        # The extra ranker binds its own ports and says which on its ready line.
        ranker = Process(
            cli("ranker", "--bundle", str(served.dir), "--listen", "127.0.0.1:0")
            + ["--metrics-port", "0", "--device", "cpu", "--threads", "1"]
        ).wait_ready_line()
        addr = ranker.address
        port = addr.rsplit(":", 1)[1]
        env = {
            "ROUTER_URL": s.url,
            "RANKER_HOST": "127.0.0.{i}",  # ordinal 1 is the extra ranker's address
            "RANKER_PORT": port,
            "PLANNED": "1",
            "MAX_RANKERS": "2",
            "INTERVAL_S": "0.2",
            "ADMIN_TOKEN_ENV": "",
        }
        sidecar = Process([sys.executable, str(MEMBERS)], env={**os.environ, **env})
        try:
            ranker.wait_ready(f"{ranker.metrics_url}/ready")

            def active() -> bool:
                rankers = membership.members(s.url)["rankers"]
                return any(r["addr"] == addr and r["state"] == "active" for r in rankers)

            wait_for(active, f"the sidecar to admit {addr}", START_S)
            check_scores(s, served)
            assert sidecar.stop() == 0  # SIGTERM ends its loop
            assert any(f"admitted ranker {addr}" in line for line in sidecar.lines)

            module = load_members()
            module.resolves = lambda host: False  # the extra ranker's pod is gone
            module.one_round(env, None)
            left = [r["addr"] for r in membership.members(s.url)["rankers"]]
            assert addr not in left and len(left) == 1, left
            check_scores(s, served)
        finally:
            sidecar.stop()
            ranker.stop()


def test_a_shard_takes_its_rows_from_the_rendered_plan_by_index(helm, bundle, big_plan, tmp_path):
    """The executable the StatefulSet runs, given the ConfigMap's plan.json and an ordinal."""
    docs = rendered(helm, big_plan)
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(docs[("ConfigMap", f"{RELEASE}-config")]["data"]["plan.json"])
    plan = load_plan(big_plan)
    index = 3
    shard = Process(
        [
            find_executable("cleave-shard"),
            *("--bundle", str(bundle), "--listen", "127.0.0.1:0", "--metrics-port", "0"),
            *("--plan", str(plan_json), "--shard-index", str(index)),
        ]
    )
    try:
        line = shard.wait_ready_line(START_S).ready_line
        tables = line.split(" tables=", 1)[1].split(",")
        want = [f"{t}={a}:{b}" for t, (a, b) in sorted(plan.shards[index].ranges.items())]
        assert sorted(tables) == sorted(want)
    finally:
        shard.stop()

    out_of_range = subprocess.run(
        [
            find_executable("cleave-shard"),
            *("--bundle", str(bundle), "--listen", "127.0.0.1:0"),
            *("--plan", str(plan_json), "--shard-index", "6"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out_of_range.returncode == 2
    assert str(plan_json) in out_of_range.stderr and "--shard-index 6" in out_of_range.stderr
    both = subprocess.run(
        [
            find_executable("cleave-shard"),
            *("--bundle", str(bundle), "--listen", "127.0.0.1:0", "--rows", "0:10"),
            *("--plan", str(plan_json), "--shard-index", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert both.returncode == 2 and "--rows" in both.stderr, both.stderr


def test_bad_values_fail_the_render_saying_what_to_change(helm, small_plan, tmp_path):
    def fails(plan: Path | None, *args: str, says: str) -> None:
        done = template(helm, plan, *args)
        assert done.returncode != 0, f"rendered with {args}"
        assert says in done.stderr, done.stderr

    fails(None, says="plan is required")
    broken = tmp_path / "broken.yaml"
    broken.write_text("format: cleave-plan\nshards: [unclosed\n")
    fails(broken, says="plan: not valid YAML")
    other = tmp_path / "other.yaml"
    other.write_text("format: helm\nversion: 1\n")
    fails(other, says="expected `format: cleave-plan`")
    text = yaml.safe_load(small_plan.read_text())
    del text["shards"]
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump(text))
    fails(missing, says='key "shards" is missing')
    fails(None, "--set", "plan=42", says="at '/plan': got number, want string")
    fails(
        small_plan,
        *("--set", "router.autoscaling.maxReplicas=0"),
        says="at '/router/autoscaling/maxReplicas': minimum: got 0, want 1",
    )
    fails(small_plan, "--set", "podDisruptionBudget.maxUnavailable=0", says="maxUnavailable")
    fails(small_plan, "--set", "ports.shard=70000", says="/ports/shard")
    fails(small_plan, "--set", "bundle.pvc=", "--set", "bundle.fetch.image=x", says="command")
    text = yaml.safe_load(small_plan.read_text())
    text["rankers"].append(
        {
            **text["rankers"][0],
            "name": "ranker-1",
            "port": 7101,
            "metrics_port": 9101,
            "max_batch": 64,
        }
    )
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(yaml.safe_dump(text))
    fails(mixed, says="rankers[1].max_batch is 64 but rankers[0].max_batch is 256")
    text = yaml.safe_load(small_plan.read_text())
    text["router"]["admin_token_env"] = "CLEAVE_ADMIN_TOKEN"
    token = tmp_path / "token.yaml"
    token.write_text(yaml.safe_dump(text))
    fails(token, says="set router.adminTokenSecret.name")
    text = yaml.safe_load(small_plan.read_text())
    text["router"]["internal_secret_env"] = "CLEAVE_SECRET"
    secret = tmp_path / "secret.yaml"
    secret.write_text(yaml.safe_dump(text))
    fails(secret, says="set internalSecret.name to a Secret")
    text = yaml.safe_load(small_plan.read_text())
    text["shards"].append({**text["shards"][0], "name": "shard-1", "queue": "edf"})
    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump(text))
    fails(queues, says="shards[1].queue is edf but shards[0].queue is fifo")
    fails(small_plan, "--set", "bundle.pvc=", says="set bundle.pvc")
    fails(small_plan, "--set", "replicas=3", says="replicas")  # not a value of this chart
