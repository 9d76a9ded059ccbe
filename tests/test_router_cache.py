"""The router's embedding cache (docs/cache.md) on a real deployment: scores bit-identical
with the cache off and on (cold and warm), no cached row served after a `cleave update`
switch (checked against the switch time the update announced), bad settings refused with
clear errors, and `cleave bench cache --quick`'s JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import cleave
import numpy as np
import pytest
from cleave.bench.loadgen import infer_body
from cleave.cli import main
from cleave.errors import UsageError
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.plan.files import save_plan
from cleave.settings.config_file import load
from cleave.update import write_delta
from support.updates import Load, run_update, score_bytes, scores, updatable_plan

CACHE_BYTES = 8 << 20


def cache_stats(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/admin/v1/cache", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A dlrm bundle, a delta rewriting every row of its largest table, the bundle with those
    rows, and a plan of one router (cache fixed), two shards with state dirs, one ranker."""
    tmp = tmp_path_factory.mktemp("cache")
    model, example = MODELS["dlrm"].factory(scale=0.01, seed=0)
    model.eval()
    partitioned = cleave.partition(model, example)
    bundle = partitioned.save(tmp / "dlrm")
    tables = json.loads((bundle / "manifest.json").read_text())["tables"]
    table = max(tables, key=lambda t: t["rows"])
    rows = np.random.default_rng(5).standard_normal((table["rows"], table["dim"]))
    rows = rows.astype(np.float32)
    delta = write_delta(tmp / "new.delta", table, np.arange(table["rows"]), rows)
    plan_path, plan = updatable_plan(bundle, tmp / "plan.yaml")
    plan.router.cache = "fixed"
    plan.router.cache_bytes = CACHE_BYTES
    save_plan(plan, plan_path)
    generator = RequestGenerator("dlrm", scale=0.01, seed=7, min_pooling=1)
    # Repeated bodies: the second of each pair hits what the first inserted.
    bodies = [infer_body(partitioned.named_inputs(*generator.batch(b))) for b in (1, 8, 4)]
    return {
        "bundle": bundle,
        "plan": plan_path,
        "name": plan.name,
        "table": table,
        "delta": delta,
        "rows": rows,
        "bodies": bodies,
    }


@pytest.fixture(scope="module")
def served(world):
    with ServeProcess(None, "--plan", str(world["plan"])) as server:
        yield server


def test_scores_are_bit_identical_with_the_cache_on_cold_and_warm(world, served):
    url = f"{served.url}/v2/models/{world['name']}/infer"
    cold = scores(url, world["bodies"])
    warm = scores(url, world["bodies"])
    with ServeProcess(world["bundle"], "--shards", "2") as plain:
        off = scores(f"{plain.url}/v2/models/{world['bundle'].name}/infer", world["bodies"])
    assert cold == off and warm == off
    s = cache_stats(served.url)
    assert s["mode"] == "fixed" and s["hits"] > 0 and s["lookups_avoided"] > 0
    assert 0 < s["bytes"] <= s["limit_bytes"] == CACHE_BYTES
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("cache_hits_total", "cache_bytes_not_sent_total", "ranker_max_batch"):
        assert f"cleave_router_{name}" in text


def test_no_cached_row_is_served_after_an_update_switches(world, served):
    url = f"{served.url}/v2/models/{world['name']}/infer"
    body = world["bodies"][1]
    old = scores(url, [body])[0]  # and now cached
    # Requests keep arriving across the switch; each notes when it was sent.
    with Load(url, [body]) as traffic:
        proc = run_update(
            world["plan"], world["table"]["name"], world["delta"], served.url,
            "--switch-margin-ms", "500",
        )  # fmt: skip
        traffic.more(5)
    assert proc.returncode == 0, proc.stderr
    assert all(status == 200 for _, status, _ in traffic.sent)
    seen = [(sent, score_bytes(reply)) for sent, _, reply in traffic.sent]
    switch_at = int(re.search(r"switch at (\d+) us", proc.stderr).group(1)) / 1e6
    new = scores(url, [body])[0]
    assert new != old
    # Sent after the switch time: arrived after it, so the new rows, never a cached old one.
    after = [s for t, s in seen if t >= switch_at]
    assert after and all(s == new for s in after)
    assert all(s in (old, new) for _, s in seen)
    assert any(s == old for t, s in seen if t < switch_at - 0.2)


def test_bad_cache_settings_are_refused_with_clear_errors(world):
    toml = world["bundle"].parent / "bad.toml"

    def refused(router: dict) -> str:
        lines = [f"{k} = {json.dumps(v)}" for k, v in router.items()]
        toml.write_text("[router]\n" + "\n".join(lines) + "\n")
        with pytest.raises(UsageError) as err:
            load(toml).check()
        return str(err.value)

    assert 'cache "fixed"' in refused({"cache": "fixed"})
    assert "memory_budget_bytes" in refused({"cache": "adaptive", "activation_bytes_per_sample": 1})
    assert "at most memory_budget_bytes" in refused(
        {"cache": "fixed", "cache_bytes": 10, "memory_budget_bytes": 5}
    )
    assert "router.cache" in refused({"cache": "lru"})
    # The router checks them too, for configs written by hand.
    config = {
        "model": "m",
        "bundle": str(world["bundle"]),
        "rankers": ["127.0.0.1:1"],
        "cache": "adaptive",
        "memory_budget_bytes": 1 << 20,
    }
    path = world["bundle"].parent / "bad-router.json"
    path.write_text(json.dumps(config))
    router = shutil.which("cleave-router", path=str(Path(sys.executable).parent))
    proc = subprocess.run([router, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "activation_bytes_per_sample" in proc.stderr, proc.stderr


@pytest.mark.parametrize("served_as", ["bundle", "repository"])
def test_rankers_measure_the_activation_an_adaptive_cache_needs(world, tmp_path, served_as):
    """No activation_bytes_per_sample given: the rankers measure theirs at start and the
    router's batch cap follows from it and the budget, for a bundle and for a model
    repository (whose router configuration is written apart)."""
    budget = 64 << 20
    toml = tmp_path / "adaptive.toml"
    toml.write_text(f'[router]\ncache = "adaptive"\nmemory_budget_bytes = {budget}\n')
    load(toml).check()  # accepted without the figure
    served, name = world["bundle"], world["bundle"].name
    if served_as == "repository":
        served, name = tmp_path / "repo", "m"
        shutil.copytree(world["bundle"], served / name / "1")
    with ServeProcess(served, "--shards", "1", "--config", str(toml)) as server:
        scores(f"{server.url}/v2/models/{name}/infer", world["bodies"][:1])
        s = cache_stats(server.url)
    activation = s["activation_bytes_per_sample"]
    # A dlrm row holds at least its dense features and pooled embeddings as float32.
    assert activation > 4 * len(world["rows"][0])
    assert s["mode"] == "adaptive" and s["budget_bytes"] == budget
    allowed = (budget - s["limit_bytes"]) // activation
    assert s["ranker_max_batch"] == min(allowed, load(toml).ranker.max_batch)


def test_bench_cache_quick_writes_every_mode_step_and_ratio(tmp_path):
    out = tmp_path / "cache.json"
    # In this process (torch is imported already), unpinned: the test's own cores stay as
    # they are.
    assert main(["bench", "cache", "--quick", "--pin", "off", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "fixed", "adaptive"}
    for rows in result["modes"].values():
        assert [r["load_share"] for r in rows] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
        for key in ("hit_rate", "lookups_sent", "lookups_avoided", "bytes_not_sent", "p99_ms"):
            assert all(key in r for r in rows), key
        assert all(r["max_batch"] >= 1 and r["goodput"] >= 0 for r in rows)
    assert all(r["hit_rate"] == 0 for r in result["modes"]["off"])
    assert any(r["hit_rate"] > 0 for r in result["modes"]["fixed"])
    assert {
        "overload_max_batch_adaptive_over_nocache",
        "overload_goodput_adaptive_over_nocache",
        "low_load_p99_adaptive_over_fixed",
        "low_load_lookups_sent_adaptive_over_fixed",
    } <= set(result["ratios"])
    assert out.with_suffix(".png").stat().st_size > 0
