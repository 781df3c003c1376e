"""MarkovTask: the batches of the demo, the tests and the e2e benchmarks, and its loss floor."""

from __future__ import annotations

import math

import pytest
import torch

from quant_lab.demo import MarkovTask


def test_batch_is_that_steps_slice_of_batches():
    task = MarkovTask(128)
    tokens = task.batches(range(5), 4, 32)
    assert tokens.shape == (5, 4, 33)
    for step in range(5):
        inputs, targets = task.batch(step, 4, 32)
        assert torch.equal(inputs, tokens[step, :, :-1])
        assert torch.equal(targets, tokens[step, :, 1:])
    assert torch.equal(MarkovTask(128).batches(range(2, 4), 4, 32), tokens[2:4])


def test_every_token_follows_the_chain():
    task = MarkovTask(256)
    tokens = task.batches(range(3), 8, 64).flatten(0, 1)
    follows = (task.next_tokens[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1)
    assert follows.all()


def test_e2e_bench_batches_are_unchanged():
    # Token ids the e2e bench trained on before MarkovTask moved here (32000-token vocabulary).
    tokens = MarkovTask(32000, seed=0).batches(range(2), 4, 2048)
    assert tokens[0, 0, :8].tolist() == [3162, 22667, 29564, 2804, 21614, 26011, 21899, 31374]
    assert tokens[1, 3, -4:].tolist() == [21273, 8823, 7117, 25640]
    assert int(tokens.sum()) == 263130092


def test_entropy_counts_a_successor_drawn_twice_once():
    task = MarkovTask(256)  # successors are drawn with replacement: some tokens repeat one
    assert any(len(set(row.tolist())) < row.numel() for row in task.next_tokens)
    want = 0.0
    for next_tokens, probabilities in zip(task.next_tokens.tolist(), task.probabilities.tolist(), strict=True):
        merged: dict[int, float] = {}
        for token, p in zip(next_tokens, probabilities, strict=True):
            merged[token] = merged.get(token, 0.0) + p
        want -= sum(p * math.log(p) for p in merged.values())
    assert math.isclose(task.entropy(), want / 256, rel_tol=1e-6)


def test_a_chain_over_fewer_states_visits_only_them():
    task = MarkovTask(1000, seed=3, states=50)
    tokens = task.batches(range(2), 4, 128)
    visited = set(tokens.unique().tolist())
    assert visited <= set(task.state_ids.tolist())
    assert len(task.state_ids) == 50
    assert len(visited) > 40  # the start tokens and successors spread over the states
    follows = (task.next_tokens[tokens[:, :, :-1]] == tokens[:, :, 1:, None]).any(-1)
    assert follows.all()
    assert 0 < task.entropy() < math.log(4)


def test_states_out_of_range_are_refused():
    with pytest.raises(ValueError, match="states must be between 1 and vocab=10"):
        MarkovTask(10, states=11)
