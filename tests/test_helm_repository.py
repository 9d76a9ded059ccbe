"""The Helm chart's repository mode (docs/deploy.md, "Serving a model repository"), offline:
`helm lint`; `helm template` with every manifest validated against Kubernetes 1.33's schemas;
the rendered serve container's command line run for real, on a repository of dlrm versions 1
and 2, with the rendered serve.toml and the admin token in the variable the Secret fills: it
serves, and the repository index lists both versions; the rendered rollout Job's script, run
for real against it, changes the split (a promotion as at install, then a canary as at a
`helm upgrade --set`), seen in the router's rollout state, the repository's rollout.json and
the versions that answer; bad values fail the render, saying what to change.

One serve process for the module. helm is built into .tools/bin by `make tools`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import tritonclient.http as httpclient
import yaml
from cleave.launch.process import ServeProcess
from cleave.repository.deployment import ROLLOUT_FILE
from support.helm import CHART, KUBERNETES, NAMESPACE, RELEASE, run_helm, template
from support.processes import get
from support.repository import Versions, infer_version
from support.served import TOLERANCE

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TOKEN = "helm-admin-token"  # what the Secret router.adminTokenSecret would hold
VALUES = {
    "repository": {
        "pvc": "models",
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
        "config": {
            "table_memory_budget": 1 << 30,
            "router": {"budget_ms": 20000, "shed": False},
            "ranker": {"threads": 1},
        },
        "rollout": [{"model": "dlrm", "version": 1, "percent": 100}],
    },
    "router": {"adminTokenSecret": {"name": "cleave-admin"}},
}
RUN_S = 120  # a bound on one rollout Job's run, never a timing assertion


@pytest.fixture(scope="module")
def values(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("helm-repository") / "values.yaml"
    path.write_text(yaml.safe_dump(VALUES))
    return path


def rendered(helm: Path, values: Path, *args: str) -> dict[tuple[str, str], dict]:
    done = template(helm, None, "--values", str(values), *args)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(docs, kind: str, name: str) -> dict:
    (one,) = docs[(kind, f"{RELEASE}-{name}")]["spec"]["template"]["spec"]["containers"]
    return one


def secret_env(one: dict) -> dict[str, dict]:
    """The container's variables filled from Secrets: {name: secretKeyRef}."""
    env = one.get("env", [])
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}


def sets(*assignments: str) -> tuple[str, ...]:
    """`--set A --set B ...`"""
    return tuple(arg for a in assignments for arg in ("--set", a))


def test_helm_lint_in_repository_mode(helm, values):
    done = run_helm(helm, "lint", str(CHART), "--kube-version", KUBERNETES, "--values", str(values))
    assert done.returncode == 0, done.stdout + done.stderr


SECURE = sets(
    "router.tlsSecret=cleave-tls",
    "router.authTokenSecret.name=cleave-tokens",
    "internalSecret.name=cleave-internal",
    "repository.rollout=null",
)


@pytest.mark.parametrize("case", ["rollout", "secure"])
def test_repository_manifests_are_valid_kubernetes(helm, values, case):
    docs = rendered(helm, values, *(SECURE if case == "secure" else ()))
    want = {"ConfigMap", "Service", "StatefulSet"} | ({"Job"} if case == "rollout" else set())
    assert {kind for kind, _ in docs} == want  # no per-role pods, HPA or PDB
    for (kind, name), doc in docs.items():
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind} {name} is not valid Kubernetes {KUBERNETES}: {err}")
    sts = docs[("StatefulSet", f"{RELEASE}-repository")]
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    serve = container(docs, "StatefulSet", "repository")
    assert serve["resources"] == VALUES["repository"]["resources"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["repository"]["persistentVolumeClaim"] == {"claimName": "models"}  # read-write
    mounts = {m["name"]: m for m in serve["volumeMounts"]}
    assert mounts["repository"] == {"name": "repository", "mountPath": "/repository"}
    service = docs[("Service", f"{RELEASE}-repository")]["spec"]
    ports = {p["name"]: p["port"] for p in service["ports"]}
    assert ports == {"http": 8000, "grpc": 8001}
    assert serve["readinessProbe"]["httpGet"]["path"] == "/ready"
    if case == "secure":  # TLS, client tokens and the internal secret as in plan mode
        assert "--tls-cert=/etc/cleave-tls/tls.crt" in serve["command"]
        assert "--auth-token-file=/etc/cleave-auth/tokens" in serve["command"]
        assert serve["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert serve["startupProbe"]["httpGet"]["scheme"] == "HTTPS"
        internal = secret_env(serve)["CLEAVE_INTERNAL_SECRET"]
        assert internal == {"name": "cleave-internal", "key": "secret"}
        toml = docs[("ConfigMap", f"{RELEASE}-config")]["data"]["serve.toml"]
        assert 'internal_secret_env = "CLEAVE_INTERNAL_SECRET"' in toml
    else:
        job = docs[("Job", f"{RELEASE}-rollout")]
        hooks = job["metadata"]["annotations"]
        assert hooks["helm.sh/hook"] == "post-install,post-upgrade"
        assert hooks["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert job["spec"]["backoffLimit"] >= 0 and job["spec"]["activeDeadlineSeconds"] > 0


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, Versions]:
    """dlrm 1 and 2 (2: other dense weights, every table 1's: no second shard)."""
    root = tmp_path_factory.mktemp("models")
    dlrm = Versions(root, "dlrm")
    dlrm.write(1)
    dlrm.write(2, dense=0.1)
    return root, dlrm


def on_this_machine(argv: list[str], substitutes: dict[str, str]) -> list[str]:
    """A rendered command line as it runs here: each item of `substitutes` replaced (every one
    must occur), `cleave` this interpreter's."""
    assert set(substitutes) <= set(argv), (substitutes, argv)
    argv = [substitutes.get(a, a) for a in argv]
    assert argv[0] == "cleave", argv
    return [sys.executable, "-m", "cleave.cli", *argv[1:]]


@pytest.fixture(scope="module")
def server(helm, values, repo, tmp_path_factory):
    """The StatefulSet's container, run here: /repository is the test's repository, the
    ConfigMap's serve.toml its config, loopback and ephemeral ports for the pod's."""
    root, _ = repo
    docs = rendered(helm, values)
    serve = container(docs, "StatefulSet", "repository")
    config = tmp_path_factory.mktemp("etc-cleave") / "serve.toml"
    config.write_text(docs[("ConfigMap", f"{RELEASE}-config")]["data"]["serve.toml"])
    argv = on_this_machine(
        serve["command"],
        {
            "/repository": str(root),
            "--config=/etc/cleave/serve.toml": f"--config={config}",
            "--host=0.0.0.0": "--host=127.0.0.1",
            "--http-port=8000": "--http-port=0",
            "--grpc-port=8001": "--grpc-port=0",
        },
    )
    assert secret_env(serve) == {"CLEAVE_ADMIN_TOKEN": {"name": "cleave-admin", "key": "token"}}
    process = ServeProcess(None)
    process.argv = argv
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CLEAVE_ADMIN_TOKEN", TOKEN)  # as the Secret fills it in the pod
        with process:
            yield process


AUTH = {"authorization": f"Bearer {TOKEN}"}


def admin_get(server, what: str) -> dict:
    request = urllib.request.Request(f"{server.url}/admin/v1/{what}", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_the_rendered_serve_command_serves_the_repository(server):
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        index = client.get_model_repository_index(headers=AUTH)
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("dlrm", "1", "READY"),
        ("dlrm", "2", "READY"),
    }
    status, _ = get(f"{server.url}/admin/v1/rollout")
    assert status == 401  # the admin token from the Secret's variable guards the admin API


def run_job(docs, server, tmp_path: Path) -> subprocess.CompletedProcess:
    """The rollout Job's container command, run here against `server`: ROUTER_URL (the
    release's Service in the pod) is the server's, `cleave` and `python` this interpreter."""
    job = container(docs, "Job", "rollout")
    assert job["command"][:2] == ["sh", "-c"]
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert env["ROUTER_URL"] == f"http://{RELEASE}-repository.{NAMESPACE}.svc:8000"
    assert secret_env(job) == {"CLEAVE_ADMIN_TOKEN": {"name": "cleave-admin", "key": "token"}}
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    (shims / "python").unlink(missing_ok=True)
    (shims / "python").symlink_to(sys.executable)
    cleave = shims / "cleave"
    cleave.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cleave.cli "$@"\n')
    cleave.chmod(0o755)
    return subprocess.run(
        job["command"],
        env={
            **os.environ,
            "PATH": f"{shims}:{os.environ['PATH']}",
            "ROUTER_URL": server.url,
            "CLEAVE_ADMIN_TOKEN": TOKEN,
        },
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )


def test_the_rendered_rollout_job_changes_the_split(helm, values, server, repo, tmp_path):
    root, dlrm = repo
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        assert infer_version(client, dlrm)[0] == "2"  # the highest version: the default

        # At install: dlrm 1 promoted (percent 100).
        done = run_job(rendered(helm, values), server, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        state = admin_get(server, "rollout")["models"]["dlrm"]
        assert (state["default"], state["canary"]) == ("1", None)
        served, error = infer_version(client, dlrm)
        assert served == "1" and error <= TOLERANCE

        # helm upgrade --set ...: a 30% canary of version 2 beside the default 1.
        upgrade = sets("repository.rollout[0].version=2", "repository.rollout[0].percent=30")
        done = run_job(rendered(helm, values, *upgrade), server, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        state = admin_get(server, "rollout")["models"]["dlrm"]
        assert (state["default"], state["canary"]) == ("1", {"version": "2", "percent": 30.0})
        persisted = json.loads((root / ROLLOUT_FILE).read_text())  # in the repository volume
        assert persisted["models"]["dlrm"]["canary"] == {"version": "2", "percent": 30.0}
        answered = []
        for i in range(40):  # a stable share of request keys goes to the canary
            served, error = infer_version(client, dlrm, headers={"cleave-request-key": f"user-{i}"})
            assert error <= TOLERANCE
            answered.append(served)
        assert set(answered) == {"1", "2"} and answered.count("2") < answered.count("1"), answered


def test_bad_repository_values_fail_the_render_saying_what_to_change(helm, values, tmp_path):
    def fails(*args: str, says: str, plan: Path | None = None, base: Path = values) -> None:
        done = template(helm, plan, "--values", str(base), *args)
        assert done.returncode != 0, f"rendered with {args}"
        assert says in done.stderr, done.stderr

    plan = tmp_path / "plan.yaml"
    plan.write_text("format: cleave-plan\nversion: 1\n")
    fails(plan=plan, says="plan and repository.pvc are both set")
    fails("--set", "repository.pvc=", says="plan is required, or repository.pvc")
    fails("--set", "repository.rollout[0].percent=150", says="/repository/rollout/0/percent")
    no_model = tmp_path / "no-model.yaml"
    no_model.write_text(yaml.safe_dump({"repository": {"rollout": [{"version": 1, "percent": 5}]}}))
    fails("--values", str(no_model), says="at '/repository/rollout/0': missing property 'model'")
    fails("--set", "repository.rollout[0].version=0", says="/repository/rollout/0/version")
    fails("--set", "repository.rollout[0].model=", says="/repository/rollout/0/model")
    unsized = json.loads(json.dumps(VALUES))
    del unsized["repository"]["config"]["table_memory_budget"]  # 0: the node's memory
    del unsized["repository"]["resources"]
    base = tmp_path / "unsized.yaml"
    base.write_text(yaml.safe_dump(unsized))
    fails(base=base, says="repository.config.table_memory_budget: set it (bytes")
    budget = "repository.config.table_memory_budget"
    fails(*sets(f"{budget}=1"), base=base, says="repository.resources.requests: set cpu")
    fails(*sets(f"{budget}=0"), says="/repository/config/table_memory_budget")
    fails("--set", "repository.config.http_port=9", says="the chart sets it; use ports.router")
    fails("--set", "repository.config.router.nope=1", says="repository.config.router.nope: unknown")
    fails("--set", "router.tlsSecret=cleave-tls", says="the rollout Job speaks plain HTTP")
    token = sets("router.adminTokenSecret.name=", "repository.config.router.admin_token_env=T")
    fails(*token, says="set router.adminTokenSecret.name")
