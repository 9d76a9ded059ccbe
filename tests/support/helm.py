"""The Helm chart's paths and the commands tests run on it: `cleave plan` for its plan and
`helm template` (helm is built into .tools/bin by `make tools`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "cleave"
HELM = ROOT / ".tools" / "bin" / "helm"
MEMBERS = CHART / "files" / "members.py"
KUBERNETES = "1.33.0"  # the pinned API version the manifests are validated against
RELEASE, NAMESPACE = "demo", "serving"


def make_plan(bundle: Path, out: Path, *args: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", str(bundle), *args, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def template(helm: Path, plan: Path | None, *args: str) -> subprocess.CompletedProcess:
    plan_args = ("--set-file", f"plan={plan}") if plan else ()
    return run_helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        *("--namespace", NAMESPACE, "--kube-version", KUBERNETES),
        *plan_args,
        *args,
    )
