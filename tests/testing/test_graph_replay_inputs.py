"""The CUDA-graph check of the conformance suite, on the CPU: the inputs it writes into a captured
forward's tensors before its second replay (``harness._other_inputs``) are other valid inputs
(other experts, so other expert sizes), the rows it compares (``harness._valid_rows``) are the
ones a layout defines, and a backend that keeps something of the inputs it was first called with
is caught. The capture itself needs a CUDA device; here a replay re-runs the captured call (what
a graph does when nothing was baked in), so only the check's own logic is under test."""

from __future__ import annotations

import pytest
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertsSetup, ExpertWeights, LayerProblem
from moe_runtime.backends.reference import ReferenceExperts
from moe_runtime.reference_math import reference_fused_experts
from moe_runtime.testing import harness
from moe_runtime.testing.harness import _dispatch_locally, _other_inputs, _valid_rows

PROBLEM = LayerProblem("t", F.BF16, F.SILU, 6, 2, 16, 8, dtype="float32")


def _layer(gen, e=6, h=16, i=8):
    return ExpertWeights(F.BF16, F.SILU, torch.randn(e, 2 * i, h, generator=gen) / 4,
                         torch.randn(e, h, i, generator=gen) / 4)


def _inputs(gen, n=5, k=2, e=6, h=16, remote=True):
    x = torch.randn(n, h, generator=gen)
    ids = torch.rand(n, e, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    if remote:
        ids[0, 1] = -1  # a slot whose expert lives on another rank (token-major cases only)
    w = torch.rand(n, k, generator=gen)
    return x, ids, w


def _reference(layout=F.TOKEN_MAJOR, cls=ReferenceExperts):
    return cls(setup=ExpertsSetup(problem=PROBLEM, runs_as=F.BF16, payload=F.UNQUANTIZED,
                                  layout=layout))


def test_token_major_inputs_move_tokens_to_other_experts_and_roll_rows_and_weights():
    gen = torch.Generator().manual_seed(1)
    weights, (x, ids, w) = _layer(gen), _inputs(gen)
    d, _, _ = _dispatch_locally(PROBLEM, F.TOKEN_MAJOR, x.clone(), ids.clone(), w.clone())
    _other_inputs(d, 6)
    assert torch.equal(d.hidden, x.roll(1, 0))
    assert torch.equal(d.topk_weights, w.roll(1, 1))
    assert (d.topk_ids[ids < 0] == -1).all()  # remote slots stay remote
    new = d.topk_ids
    assert all(len(set(r.tolist()) - {-1}) == int((r >= 0).sum()) for r in new)  # distinct
    sizes = lambda t: torch.bincount(t[t >= 0].long(), minlength=6)
    assert not torch.equal(sizes(new), sizes(ids))  # the experts' sizes change
    backend = _reference()
    backend.prepare(weights)
    got = _valid_rows(d, backend.forward(d))
    want = reference_fused_experts(d.hidden, d.topk_ids, d.topk_weights, weights).float()
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, reference_fused_experts(x, ids, w, weights).float(), atol=1e-2)


def test_masked_inputs_hold_one_row_fewer_per_expert_and_only_valid_rows_count():
    gen = torch.Generator().manual_seed(2)
    x, ids, w = _inputs(gen, n=9, remote=False)
    d, _, _ = _dispatch_locally(PROBLEM, F.MASKED, x, ids, w)
    before, m = d.hidden.clone(), d.masked_m.clone()
    _other_inputs(d, 6)
    assert torch.equal(d.hidden, before.roll(1, 1))
    assert torch.equal(d.masked_m, torch.where(m > 1, m - 1, m))
    rows = _valid_rows(d, d.hidden)
    assert rows.shape == (int(d.masked_m.sum()), 16)


def test_float8_inputs_are_rolled_as_bytes(monkeypatch):
    """CUDA has no float8 roll: the check rolls their bytes (a roll that refuses float8 here
    stands for CUDA's)."""
    real = torch.Tensor.roll

    def no_float8(self, *a, **k):
        if self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise RuntimeError("roll not implemented for Float8")
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "roll", no_float8)
    gen = torch.Generator().manual_seed(3)
    x, ids, w = _inputs(gen)
    d, _, _ = _dispatch_locally(PROBLEM, F.TOKEN_MAJOR, x, ids, w)
    d.hidden = x.to(torch.float8_e4m3fn)
    codes = d.hidden.view(torch.uint8).clone()
    _other_inputs(d, 6)
    assert torch.equal(d.hidden.view(torch.uint8), codes.roll(1, 0))


class _KeepsItsFirstRouting(ReferenceExperts):
    """Dishonest about graphs: the routing of its first call is kept and reused."""

    def forward(self, d):
        if not hasattr(self, "_ids"):
            self._ids = d.topk_ids.clone()
        d2 = type(d)(d.layout, d.hidden, topk_ids=self._ids, topk_weights=d.topk_weights,
                     out_dtype=d.out_dtype)
        return super().forward(d2)


def _replay_by_recall(executor, batches, device):
    out = executor(*batches[0])
    return [(lambda: out.copy_(executor(*batches[0])), out)]


@pytest.mark.parametrize("cls, caught", [(ReferenceExperts, False), (_KeepsItsFirstRouting, True)])
def test_a_forward_that_keeps_its_first_inputs_is_caught(monkeypatch, cls, caught):
    import moe_runtime.tuning.measure as measure

    monkeypatch.setattr(measure, "capture_graphs", _replay_by_recall)
    gen = torch.Generator().manual_seed(4)
    weights, (x, ids, w) = _layer(gen), _inputs(gen, n=12)
    d, handle, comm = _dispatch_locally(PROBLEM, F.TOKEN_MAJOR, x, ids, w)
    backend = _reference(cls=cls)
    backend.prepare(weights)
    eager = backend.forward(d)

    def fresh():
        other = _reference(cls=cls)
        other.prepare(weights)
        return other

    first, problem = harness._graph_replay(
        type("Case", (), {"id": "case", "backend": "b"})(), backend, d, eager, "replay",
        lambda o: comm.combine(o, handle).float(), fresh, 6)
    assert torch.allclose(first, eager.float(), atol=1e-5)
    assert bool(problem) is caught, problem
