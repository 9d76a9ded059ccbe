"""Reference models and their request generators (python/cleave/models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cleave.errors import UsageError
from cleave.models import MODELS, RequestGenerator, table_bytes
from cleave.models.dlrm import KAGGLE_ROWS
from cleave.models.requests import ZipfSampler, row_permutation
from torch import nn
from torch.export import Dim, export
from torch.utils._pytree import tree_map

# Small tables keep the file fast; DCN's dense half dominates its cost whatever the scale.
SMALL = {"dlrm": 0.001, "dcn": 0.0001, "din": 0.001, "shared": 0.001}
# TorchRec's reference models are tests/test_torchrec.py's.
NAMES = sorted(name for name, entry in MODELS.items() if not entry.torchrec)


def build(name: str, seed: int = 0, batch: int = 5):
    return MODELS[name].factory(scale=SMALL[name], seed=seed, batch=batch)


def generator(name: str, **kwargs) -> RequestGenerator:
    return RequestGenerator(name, scale=SMALL[name], **kwargs)


def score(model: nn.Module, args: tuple) -> torch.Tensor:
    with torch.no_grad():
        return model(*args)


def tables(model: nn.Module) -> dict[str, int]:
    """Rows of every embedding table in the model, by module name."""
    return {
        name: m.weight.shape[0]
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    }


def lookups(name: str, model: nn.Module, args: tuple) -> list[tuple[torch.Tensor, int]]:
    """(ids as the table sees them, rows of that table) for every lookup of one request."""
    if name == "dlrm":
        return [
            (ids % bag.weight.shape[0], bag.weight.shape[0])
            for ids, bag in zip(args[1], model.emb_l, strict=True)
        ]
    if name == "dcn":
        return [(ids, bag.weight.shape[0]) for ids, bag in zip(args[1], model.emb_l, strict=True)]
    if name == "din":
        hist, profile, _, items, cats = args
        item_rows = model.item.weight.shape[0]
        return [
            (hist, item_rows),
            (profile, model.profile.weight.shape[0]),
            (items, item_rows),
            (cats, model.category.weight.shape[0]),
        ]
    terms = model.terms.weight.shape[0]
    return [
        *((ids, terms) for ids in args[1]),
        (args[4], model.pages.weight.shape[0]),
        (args[6], model.ads.weight.shape[0]),
        (args[8], model.slots.weight.shape[0]),
    ]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    s, y = scores.double().numpy(), labels.numpy() == 1
    ranks = np.empty(len(s))
    ranks[np.argsort(s, kind="stable")] = np.arange(1, len(s) + 1)
    pos, neg = y.sum(), (~y).sum()
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def assert_same_inputs(a, b) -> None:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("name", NAMES)
def test_factory_is_deterministic_in_its_seed(name):
    model, example = build(name)
    again, example_again = build(name)
    other, _ = build(name, seed=1)
    state, state_again, state_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert state.keys() == state_again.keys()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert not all(torch.equal(state[k], state_other[k]) for k in state)
    assert_same_inputs(example, example_again)
    assert torch.equal(score(model, example), score(again, example))
    assert not torch.equal(score(model, example), score(other, example))


@pytest.mark.parametrize("name", NAMES)
def test_example_inputs_suit_torch_export(name):
    # torch.export specialises sizes 0 and 1: batches of >= 3, bags of varying length >= 2.
    _, example = build(name, batch=4)
    assert all(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(example))
    if name == "din":
        hist, profile, offsets, items, cats = example
        assert hist.shape[0] == 1 and offsets.shape == (1,)  # the shared user part
        assert hist.shape[1] >= 2 and len(profile) >= 2 and len(items) == len(cats) == 4
        return
    offsets = example[2] if name in ("dlrm", "dcn") else [*example[2], example[5], example[7]]
    for o in offsets:
        assert len(o) == 4
        lengths = torch.diff(o)
        assert lengths.min() >= 2 and lengths.unique().numel() > 1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 3, 33])
def test_scores_are_finite_probabilities_for_any_batch_and_empty_bags(name, batch):
    model, _ = build(name)
    gen = generator(name, seed=batch, pooling=1.5, min_pooling=0)
    empty_bags = 0
    for _ in range(3):
        args = gen.batch(batch)
        out = score(model, args)
        assert out.shape == (batch, 1) and out.dtype == torch.float32
        assert torch.isfinite(out).all() and ((out > 0) & (out < 1)).all()
        flat = torch.utils._pytree.tree_leaves(args)
        empty_bags += sum(int((torch.diff(t) == 0).sum()) for t in flat if t.dtype == torch.int64)
    assert empty_bags > 0 or batch == 1  # pooling 1.5 with min 0: ~22% of bags are empty


@pytest.mark.parametrize("name", NAMES)
def test_scores_are_spread_not_saturated(name):
    model, _ = build(name)
    logits = torch.logit(score(model, generator(name, seed=7).batch(256)).double())
    assert 0.1 < logits.std() < 5 and logits.abs().max() < 15


@pytest.mark.parametrize("name", NAMES)
def test_generated_ids_fit_the_tables(name):
    model, _ = build(name)
    spec_rows = {f.rows for f in MODELS[name].features(SMALL[name])}
    assert spec_rows == set(tables(model).values())
    for alpha in (0.0, 1.05):  # uniform ids reach the top of every table
        args = generator(name, alpha=alpha, seed=3).batch(512)
        for ids, rows in lookups(name, model, args):
            assert ids.dtype == torch.int64
            assert 0 <= int(ids.min()) and int(ids.max()) < rows


def test_dlrm_raw_ids_exceed_the_tables_and_are_hashed_in_forward():
    model, _ = build("dlrm")
    args = generator("dlrm", alpha=0.0).batch(512)
    exceeded = 0
    for ids, bag, raw_rows in zip(args[1], model.emb_l, KAGGLE_ROWS, strict=True):
        assert int(ids.max()) < raw_rows
        exceeded += int((ids >= bag.weight.shape[0]).sum())
    assert exceeded > 0
    # Hashing is part of the model: pre-hashed ids give the same scores.
    hashed = [ids % bag.weight.shape[0] for ids, bag in zip(args[1], model.emb_l, strict=True)]
    assert torch.equal(score(model, args), score(model, (args[0], hashed, args[2])))


def top_share(ids: np.ndarray, fraction: float = 0.01, rows: int = 0) -> float:
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1]
    return counts[: max(1, int(len(counts) * fraction))].sum() / counts.sum()


def test_zipf_skew_is_measurable_and_alpha_zero_is_uniform():
    rows = 40_000
    skewed = ZipfSampler(rows, 1.05).sample(np.random.default_rng(0), 50_000)
    uniform = ZipfSampler(rows, 0.0).sample(np.random.default_rng(0), 50_000)
    assert 0 <= skewed.min() and skewed.max() < rows and uniform.max() < rows
    assert top_share(skewed, rows=rows) > 0.4
    assert top_share(uniform, rows=rows) < 0.1
    # Rank 0 is drawn with probability 1 / H(rows, alpha).
    harmonic = (np.arange(1, rows + 1, dtype=np.float64) ** -1.05).sum()
    assert abs((skewed == 0).mean() - 1 / harmonic) < 0.01


def test_generator_skew_follows_alpha_for_a_large_table():
    def ids(alpha):
        gen = RequestGenerator("dcn", scale=0.001, alpha=alpha, seed=1)
        return torch.cat([gen.batch(2_000)[1][0] for _ in range(5)]).numpy()  # 40 k rows

    assert top_share(ids(1.05), rows=40_000) > 0.4
    assert top_share(ids(0.0), rows=40_000) < 0.1


@pytest.mark.parametrize("rows", [2, 3, 4, 10, 16, 1000, 65536, 999_983])
def test_row_permutation_is_a_bijection(rows):
    mult, shift = row_permutation("t0", rows)
    ranks = np.arange(rows, dtype=np.int64)
    assert np.unique((ranks * mult + shift) % rows).size == rows


def test_pooling_mean_and_minimum_are_honoured():
    gen = RequestGenerator("dlrm", scale=0.001, pooling=6.0, min_pooling=2, seed=4)
    lengths = torch.cat(
        [
            torch.diff(o, append=torch.tensor([len(i)]))
            for i, o in zip(*gen.batch(2_000)[1:], strict=True)
        ]
    )
    assert lengths.min() >= 2
    assert abs(lengths.double().mean() - 6.0) < 0.1
    one_hot = RequestGenerator("dlrm", scale=0.001, seed=4).batch(64)
    assert all(len(ids) == 64 for ids in one_hot[1])  # Criteo Kaggle features are one-hot


def test_dcn_default_pooling_follows_the_multi_hot_sizes():
    from cleave.models.dcn import MULTI_HOT

    _, ids, _ = RequestGenerator("dcn", scale=0.0001, seed=2).batch(1_000)
    means = [len(t) / 1_000 for t in ids]
    assert means == pytest.approx(MULTI_HOT, rel=0.1)


def test_generator_is_deterministic_in_its_seed():
    assert_same_inputs(generator("shared", seed=5).batch(16), generator("shared", seed=5).batch(16))
    a, b = generator("shared", seed=5).batch(16), generator("shared", seed=6).batch(16)
    assert not torch.equal(a[1][0], b[1][0])


def test_generator_accepts_a_factory_and_the_entry():
    entry = MODELS["din"]
    by_factory = RequestGenerator(entry.factory, scale=SMALL["din"], seed=1).batch(8)
    assert_same_inputs(by_factory, entry.generator(scale=SMALL["din"], seed=1).batch(8))


def test_din_scores_each_candidate_as_if_alone():
    model, _ = build("din")
    hist, profile, offsets, items, cats = generator("din", seed=9).batch(12)
    assert hist.shape[0] == 1 and offsets.tolist() == [0]  # one user per request
    together = score(model, (hist, profile, offsets, items, cats))
    alone = torch.cat(
        [
            score(model, (hist, profile, offsets, items[i : i + 1], cats[i : i + 1]))
            for i in range(12)
        ]
    )
    torch.testing.assert_close(together, alone)


def test_shared_model_reuses_one_table_with_per_sample_weights():
    model, _ = build("shared")
    args = list(generator("shared", seed=2).batch(8))
    weights = args[3]
    assert [len(w) for w in weights] == [len(i) for i in args[1][: len(weights)]]
    base = score(model, tuple(args))
    args[3] = [w * 2 for w in weights]  # the weights reach the pooled sums
    assert not torch.allclose(base, score(model, tuple(args)))


@pytest.mark.parametrize("name", NAMES)
def test_tables_at_the_default_scale_fit_a_small_machine(name):
    entry = MODELS[name]
    spec_bytes = table_bytes(entry.features(entry.default_scale))
    assert spec_bytes <= 200e6
    model, _ = entry.factory()
    embedding_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    )
    assert embedding_bytes == spec_bytes


@pytest.mark.parametrize("name", NAMES)
def test_export_with_every_dim_auto_serves_other_batch_sizes(name):
    model, example = build(name)
    dynamic = tree_map(lambda t: {i: Dim.AUTO for i in range(t.dim())}, example)
    program = export(model, example, dynamic_shapes=dynamic).module()
    for batch, min_pooling in [(11, 0), (64, 1)]:
        args = generator(name, seed=batch, min_pooling=min_pooling, pooling=2.0).batch(batch)
        torch.testing.assert_close(score(program, args), score(model, args))


@pytest.mark.parametrize("name", NAMES)
def test_labelled_samples_come_from_a_teacher_with_meaningful_auc(name):
    gen = generator(name, seed=3)
    data = gen.labelled(300, batch_size=120)
    assert [len(labels) for _, labels in data] == [120, 120, 60]
    labels = torch.cat([y for _, y in data])
    assert set(labels.unique().tolist()) == {0.0, 1.0}
    teacher, _ = build(name, seed=3)
    stranger, _ = build(name, seed=4)
    teacher_auc = auc(torch.cat([score(teacher, a).flatten() for a, _ in data]), labels)
    stranger_auc = auc(torch.cat([score(stranger, a).flatten() for a, _ in data]), labels)
    assert teacher_auc > 0.8
    assert stranger_auc < teacher_auc - 0.15
    assert torch.equal(
        labels, torch.cat([y for _, y in generator(name, seed=3).labelled(300, 120)])
    )


def test_bad_arguments_are_reported():
    with pytest.raises(UsageError, match="unknown model 'nope'.*dcn"):
        RequestGenerator("nope")
    with pytest.raises(UsageError, match="no request layout"):
        RequestGenerator(lambda: None)
    with pytest.raises(UsageError, match="batch_size must be an int >= 1, got 0"):
        generator("dlrm").batch(0)
    with pytest.raises(UsageError, match="alpha must be .* got -1"):
        RequestGenerator("dlrm", alpha=-1)
    with pytest.raises(UsageError, match="pooling must be .* got 0"):
        RequestGenerator("dlrm", pooling=0)
    with pytest.raises(UsageError, match="min_pooling must be .* got -1"):
        RequestGenerator("dlrm", min_pooling=-1)
    with pytest.raises(UsageError, match="scale must be .* got 0"):
        MODELS["dlrm"].factory(scale=0)
    with pytest.raises(UsageError, match="example batch must be an int >= 3.*got 1"):
        MODELS["shared"].factory(scale=0.001, batch=1)
