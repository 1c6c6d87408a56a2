"""Per-rank bodies of the multi-process tests (imported by spawned processes).

References, all from moe-runtime's core:
- ``reference_a2a``: ``TorchAllToAll`` (token-major) + ``ReferenceExperts`` on this rank's experts;
- ``reference_local_masked``: ``LocalComm`` (masked) + ``ReferenceExperts`` holding every expert, on
  this rank's own tokens: the masked-layout semantics (unweighted expert rows rounded to the model
  dtype, weights applied in combine), which DeepEP's low-latency pair implements across ranks.
"""

from __future__ import annotations

import deepep_sim
import torch
import torch.distributed as dist
from moe_runtime import formats as F
from moe_runtime.backend_api import CommSetup, ExpertsSetup, ExpertWeights, LayerProblem
from moe_runtime.backends.all_to_all import TorchAllToAll
from moe_runtime.backends.local import LocalComm
from moe_runtime.backends.reference import ReferenceExperts
from moe_runtime.placement import local_experts

from moe_runtime_deepep import layout as L
from moe_runtime_deepep.backend import DeepEPComm, DeepEPError, DeepEPTokenBoundError
from moe_runtime_deepep.settings import DeepEPSettings

SMALL_HIDDEN = (128, 256)  # the tests' low-latency hidden sizes (named through the setting)


def problem(num_experts=8, top_k=2, hidden=128, inter=64, dtype="bfloat16") -> LayerProblem:
    return LayerProblem(name="model.layers.0.mlp.experts", format=F.BF16, activation=F.SILU,
                        num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                        intermediate_size=inter, dtype=dtype)


def global_weights(p: LayerProblem, seed: int = 7) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(p.num_experts, 2 * p.intermediate_size, p.hidden_size, generator=g) * 0.05)
    w2 = (torch.randn(p.num_experts, p.hidden_size, p.intermediate_size, generator=g) * 0.05)
    return ExpertWeights(F.BF16, p.activation, w13.bfloat16(), w2.bfloat16())


def local_weights(w: ExpertWeights, rank: int, world: int) -> ExpertWeights:
    mine = local_experts(w.num_experts, world, rank)
    sl = slice(mine.start, mine.stop)
    return ExpertWeights(w.format, w.activation, w.w13[sl].clone(), w.w2[sl].clone())


def tokens(p: LayerProblem, n: int, rank: int, seed: int = 11, exact_fp8_scale=None):
    """``n`` tokens of this rank: hidden bf16, distinct top-k ids, float32 weights."""
    g = torch.Generator().manual_seed(seed + 1000 * rank + n)
    if exact_fp8_scale is None:
        hidden = torch.randn(n, p.hidden_size, generator=g).bfloat16()
    else:  # values that are exactly fp8 codes times the scale: every quantizer agrees on them
        codes = torch.randint(-96, 96, (n, p.hidden_size), generator=g).to(torch.int8)
        fp8 = codes.view(torch.float8_e4m3fn).float()
        fp8 = torch.nan_to_num(fp8, nan=1.0).clamp(-448, 448)
        hidden = (fp8 * exact_fp8_scale).bfloat16()
    ids = torch.stack([torch.randperm(p.num_experts, generator=g)[: p.top_k] for _ in range(n)]) \
        if n else torch.zeros((0, p.top_k), dtype=torch.int64)
    weights = torch.rand(n, p.top_k, generator=g)
    return hidden, ids.to(torch.int32), weights


def experts(p, rank, world, layout, payload=F.UNQUANTIZED, weights=None):
    ex = ReferenceExperts(setup=ExpertsSetup(problem=p, runs_as=F.BF16, payload=payload,
                                             layout=layout, ep_rank=rank, ep_size=world))
    ex.prepare(weights)
    return ex


def reference_a2a(p, rank, world, hidden, ids, w, payload=F.UNQUANTIZED, input_scale=None):
    gw = global_weights(p)
    comm = TorchAllToAll(setup=CommSetup(problem=p, payload=payload, layout=F.TOKEN_MAJOR,
                                         ep_rank=rank, ep_size=world))
    ex = experts(p, rank, world, F.TOKEN_MAJOR, payload, local_weights(gw, rank, world))
    d, h = comm.dispatch(hidden, ids, w, input_scale=input_scale)
    return comm.combine(ex.forward(d), h), d


def reference_local_masked(p, hidden, ids, w):
    gw = global_weights(p)
    comm = LocalComm(setup=CommSetup(problem=p, payload=F.UNQUANTIZED, layout=F.MASKED))
    ex = experts(p, 0, 1, F.MASKED, F.UNQUANTIZED, gw)
    d, h = comm.dispatch(hidden, ids, w)
    return comm.combine(ex.forward(d), h)


def deepep(p, rank, world, layout, payload=F.UNQUANTIZED, *,
           buffer_cls=deepep_sim.SimulatedBufferV12, max_tokens=8, settings=None):
    settings = settings or DeepEPSettings(ll_hidden_sizes=SMALL_HIDDEN)
    setup = CommSetup(problem=p, payload=payload, layout=layout, ep_rank=rank, ep_size=world,
                      max_tokens_per_rank=max_tokens)
    low_latency = layout == F.MASKED
    buf = buffer_cls(dist.group.WORLD, 0, 1 << 20, low_latency_mode=low_latency)
    return DeepEPComm(setup=setup, buffer=buf, settings=settings), buf


# ------------------------------------------------------------------ layout.py vs TorchAllToAll


def expert_fn(x: torch.Tensor, global_expert: int) -> torch.Tensor:
    """A stand-in expert, elementwise and exact to compare bit for bit."""
    return x.float() * (global_expert + 1) + 0.5


def layout_against_reference(rank, world, n_tokens):
    """tokens_to_masked / masked_to_tokens on TorchAllToAll's received rows equal the token-major
    computation, and through its combine equal the all-local result."""
    p = problem(num_experts=4 * world, top_k=3)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    comm = TorchAllToAll(setup=CommSetup(problem=p, payload=F.UNQUANTIZED, layout=F.TOKEN_MAJOR,
                                         ep_rank=rank, ep_size=world))
    d, handle = comm.dispatch(hidden, ids, w)
    mine = local_experts(p.num_experts, world, rank)
    per = len(mine)
    n_recv = d.hidden.shape[0]
    m = L.tokens_to_masked(d.hidden, d.topk_ids, per, max_rows=max(n_recv, 1))
    # masked_m is the per-local-expert count of the received ids (DeepEP's recv counts)
    ids_flat = d.topk_ids.reshape(-1).long()
    want = torch.bincount(ids_flat[ids_flat >= 0], minlength=per).to(torch.int32)
    assert torch.equal(m.masked_m, want), (m.masked_m, want)
    # every (token, k) row sits where slot says
    for t in range(n_recv):
        for k in range(p.top_k):
            e = int(d.topk_ids[t, k])
            if e >= 0:
                assert torch.equal(m.hidden[e, m.slot[t, k]], d.hidden[t])
            else:
                assert int(m.slot[t, k]) == -1
    outs = torch.zeros(m.hidden.shape, dtype=torch.float32)
    for e in range(per):
        outs[e] = expert_fn(m.hidden[e], mine[e])
    partial = L.masked_to_tokens(outs, d.topk_ids, m.slot, d.topk_weights)
    direct = torch.zeros((n_recv, p.hidden_size), dtype=torch.float32)
    for k in range(p.top_k):
        e = d.topk_ids[:, k].long()
        ok = e >= 0
        vals = torch.zeros_like(direct)
        for le in range(per):
            sel = e == le
            vals[sel] = expert_fn(d.hidden[sel], mine[le])
        direct += torch.where(ok[:, None], vals, torch.zeros_like(vals)) * torch.where(
            ok, d.topk_weights[:, k], torch.zeros_like(d.topk_weights[:, k]))[:, None]
    assert torch.equal(partial, direct)
    back = comm.combine(partial, handle).float()  # TorchAllToAll returns the tokens' dtype
    local = torch.zeros_like(back)
    for t in range(hidden.shape[0]):
        for k in range(p.top_k):
            local[t] += expert_fn(hidden[t:t + 1], int(ids[t, k]))[0] * w[t, k]
    # the reference combine returns the model dtype (bf16): compare to one bf16 rounding
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, local.bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    return {"recv": n_recv, "masked_m": m.masked_m.tolist()}


# ------------------------------------------------------------------ the backend on the simulation


def normal_mode_matches_reference(rank, world, n_tokens):
    p = problem(num_experts=2 * world)
    gw = global_weights(p)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    want, ref_d = reference_a2a(p, rank, world, hidden, ids, w)
    comm, buf = deepep(p, rank, world, F.TOKEN_MAJOR)
    d, h = comm.dispatch(hidden, ids, w)
    # the token-major Dispatched is the reference's: same rows, same order, same local ids
    assert d.layout == F.TOKEN_MAJOR and d.payload == F.UNQUANTIZED
    assert torch.equal(d.hidden, ref_d.hidden)
    assert torch.equal(d.topk_ids, ref_d.topk_ids)
    assert d.topk_ids.dtype == torch.int32
    valid = d.topk_ids >= 0
    assert torch.equal(d.topk_weights[valid], ref_d.topk_weights[valid])
    n_local = len(local_experts(p.num_experts, world, rank))
    counts = torch.bincount(d.topk_ids[valid].long(), minlength=n_local)
    assert d.extra["tokens_per_expert"] == counts.tolist()
    ex = experts(p, rank, world, F.TOKEN_MAJOR, F.UNQUANTIZED, local_weights(gw, rank, world))
    got = comm.combine(ex.forward(d), h)
    assert got.dtype == hidden.dtype and got.shape == hidden.shape
    assert torch.equal(got, want), (got - want).abs().max()
    return [c for c in buf.calls]


def normal_mode_fp8_matches_reference(rank, world, n_tokens):
    p = problem(num_experts=2 * world, hidden=256)
    gw = global_weights(p)
    scale = torch.tensor(2.0 ** -4)
    hidden, ids, w = tokens(p, n_tokens[rank], rank, exact_fp8_scale=scale)
    want, ref_d = reference_a2a(p, rank, world, hidden, ids, w, payload=F.FP8, input_scale=scale)
    comm, _ = deepep(p, rank, world, F.TOKEN_MAJOR, F.FP8)
    d, h = comm.dispatch(hidden, ids, w, input_scale=scale)
    assert d.payload == F.FP8 and d.hidden.dtype == torch.float8_e4m3fn
    assert torch.equal(d.hidden.view(torch.uint8), ref_d.hidden.view(torch.uint8))
    assert float(d.hidden_scale) == float(scale)  # the layer's own scale, not a dynamic one
    ex = experts(p, rank, world, F.TOKEN_MAJOR, F.FP8, local_weights(gw, rank, world))
    got = comm.combine(ex.forward(d), h)
    assert torch.equal(got, want), (got - want).abs().max()
    # without the layer's scale the fp8 payload is refused, not guessed
    try:
        comm.dispatch(hidden, ids, w)
    except DeepEPError as exc:
        assert "input scale" in str(exc)
    else:
        raise AssertionError("fp8 dispatch without an input scale was not refused")
    return True


def low_latency_matches_reference(rank, world, n_tokens, max_tokens):
    p = problem(num_experts=2 * world, top_k=3)
    gw = global_weights(p)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    want_masked = reference_local_masked(p, hidden, ids, w)
    want_a2a, ref_d = reference_a2a(p, rank, world, hidden, ids, w)
    comm, buf = deepep(p, rank, world, F.MASKED, max_tokens=max_tokens)
    d, h = comm.dispatch(hidden, ids, w)
    per = len(local_experts(p.num_experts, world, rank))
    assert d.layout == F.MASKED and d.hidden.shape == (per, max_tokens * world, p.hidden_size)
    # the received rows per expert are the reference's rows (as a multiset; order is DeepEP's)
    ref_m = L.tokens_to_masked(ref_d.hidden, ref_d.topk_ids, per,
                               max_rows=max(1, ref_d.hidden.shape[0]))
    assert torch.equal(d.masked_m, ref_m.masked_m)
    for e in range(per):
        c = int(d.masked_m[e])
        a = sorted(map(tuple, d.hidden[e, :c].float().tolist()))
        b = sorted(map(tuple, ref_m.hidden[e, :c].float().tolist()))
        assert a == b
    ex = experts(p, rank, world, F.MASKED, F.UNQUANTIZED, local_weights(gw, rank, world))
    got = comm.combine(ex.forward(d), h)
    assert got.dtype == hidden.dtype and got.shape == hidden.shape
    torch.testing.assert_close(got.float(), want_masked.float(), rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(got.float(), want_a2a.float(), rtol=3e-2, atol=2e-3)
    return buf.calls


class HostSyncCounter:
    """While active, records every host read of a tensor (``.item()``, ``.tolist()``, ``int(t)``,
    ...) and every ``torch.distributed`` collective, with the file that called it.

    The simulation's own calls (its gloo all-to-all, its Python loops) stand for DeepEP's kernels
    and are recorded too, which shows the counter sees inside the forward.
    """

    READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")
    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                   "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
                   "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                   "all_to_all_single", "send", "recv", "isend", "irecv")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (name, calling file)
        self._undo: list = []

    def _wrap(self, owner, name):
        original = getattr(owner, name)
        own = name in vars(owner)
        calls = self.calls

        def counted(*args, **kwargs):
            import sys

            calls.append((name, sys._getframe(1).f_code.co_filename))
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append((owner, name, original if own else None))

    def __enter__(self):
        for name in self.READS:
            self._wrap(torch.Tensor, name)
        for name in self.COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def by(self, path_part: str) -> list[str]:
        return [name for name, file in self.calls if path_part in file]


def low_latency_forward_without_host_sync(rank, world, n_tokens, settings_kw, max_tokens):
    """A low-latency forward (dispatch, experts, combine) makes no host read and no collective of
    its own: only the simulated DeepEP calls exchange anything."""
    import moe_runtime_deepep

    p = problem(num_experts=2 * world, top_k=2)
    gw = global_weights(p)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    want = reference_local_masked(p, hidden, ids, w)
    settings = DeepEPSettings(ll_hidden_sizes=SMALL_HIDDEN, **settings_kw)
    comm, buf = deepep(p, rank, world, F.MASKED, max_tokens=max_tokens, settings=settings)
    ex = experts(p, rank, world, F.MASKED, F.UNQUANTIZED, local_weights(gw, rank, world))
    with HostSyncCounter() as counter:
        d, h = comm.dispatch(hidden, ids, w)
        out = ex.forward(d)
        got = comm.combine(out, h)
    plugin_dir = moe_runtime_deepep.__path__[0]
    assert counter.by(plugin_dir) == [], counter.by(plugin_dir)
    collectives = [(n, f) for n, f in counter.calls if n in HostSyncCounter.COLLECTIVES]
    assert collectives and all(f == deepep_sim.__file__ for _, f in collectives), collectives
    assert counter.by(deepep_sim.__file__.rsplit("/", 1)[-1])  # the counter saw the forward
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    return [n for k, n in buf.calls if k == "low_latency_dispatch"]


def low_latency_refused_on_its_rank(rank, world, n_tokens, max_tokens, settings_kw):
    """A batch above the bound on one rank: that rank sends DeepEP nothing and its combine raises;
    the others finish the forward with the right output, and the next forward runs on all."""
    p = problem(num_experts=2 * world, top_k=2)
    gw = global_weights(p)
    settings = DeepEPSettings(ll_hidden_sizes=SMALL_HIDDEN, **settings_kw)
    comm, buf = deepep(p, rank, world, F.MASKED, max_tokens=max_tokens, settings=settings)
    ex = experts(p, rank, world, F.MASKED, F.UNQUANTIZED, local_weights(gw, rank, world))
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    d, h = comm.dispatch(hidden, ids, w)
    sent = [n for k, n in buf.calls if k == "low_latency_dispatch"]
    out = ex.forward(d)
    try:
        got = comm.combine(out, h)
    except DeepEPTokenBoundError as exc:
        result = {"refused": str(exc), "sent": sent}
    else:
        want = reference_local_masked(p, hidden, ids, w)
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
        result = {"refused": None, "sent": sent}
    # the group is not left behind: a forward within the bound runs on every rank
    hidden, ids, w = tokens(p, 3, rank)
    d, h = comm.dispatch(hidden, ids, w)
    got = comm.combine(ex.forward(d), h)
    want = reference_local_masked(p, hidden, ids, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    return result


def low_latency_split_equals_one_round(rank, world, n_tokens, per_call, per_forward):
    """Split into rounds of ``per_call`` tokens, up to ``per_forward`` per forward, gives the output
    of one round holding the whole batch (twice: DeepEP's buffers alternate)."""
    p = problem(num_experts=2 * world, top_k=2)
    gw = global_weights(p)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    split = DeepEPSettings(ll_hidden_sizes=SMALL_HIDDEN, ll_max_tokens_per_rank=per_call,
                           ll_oversize="split", ll_split_max_tokens_per_rank=per_forward)
    one = DeepEPSettings(ll_hidden_sizes=SMALL_HIDDEN)
    comm, buf = deepep(p, rank, world, F.MASKED, max_tokens=per_forward, settings=split)
    whole, _ = deepep(p, rank, world, F.MASKED, max_tokens=per_forward, settings=one)
    assert (comm.bound, comm.rounds, whole.bound, whole.rounds) == (
        per_call, -(-per_forward // per_call), per_forward, 1)
    ex = experts(p, rank, world, F.MASKED, F.UNQUANTIZED, local_weights(gw, rank, world))
    d, h = whole.dispatch(hidden, ids, w)
    want = whole.combine(ex.forward(d), h)
    for _ in range(2):
        d, h = comm.dispatch(hidden, ids, w)
        got = comm.combine(ex.forward(d), h)
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    return [n for k, n in buf.calls if k == "low_latency_dispatch"]


def low_latency_refused_on_v100(rank, world):
    p = problem(num_experts=2 * world)
    try:
        deepep(p, rank, world, F.MASKED, buffer_cls=deepep_sim.SimulatedBufferV100)
    except DeepEPError as exc:
        return str(exc)
    raise AssertionError("the 1.0.0 low-latency API (FP8 only) was accepted for a bf16 plan")


def normal_mode_on_v100(rank, world, n_tokens):
    """The 1.0.0 API runs normal mode (its dispatch/combine take the same keywords)."""
    p = problem(num_experts=2 * world)
    gw = global_weights(p)
    hidden, ids, w = tokens(p, n_tokens[rank], rank)
    want, _ = reference_a2a(p, rank, world, hidden, ids, w)
    comm, _ = deepep(p, rank, world, F.TOKEN_MAJOR, buffer_cls=deepep_sim.SimulatedBufferV100)
    d, h = comm.dispatch(hidden, ids, w)
    ex = experts(p, rank, world, F.TOKEN_MAJOR, F.UNQUANTIZED, local_weights(gw, rank, world))
    assert torch.equal(comm.combine(ex.forward(d), h), want)
    return True


# ------------------------------------------------------------------ GPUs with DeepEP (not run yet)


def gpu_against_reference(rank, world, n_tokens, max_tokens):
    """Real DeepEP on CUDA (NCCL group): normal mode against TorchAllToAll, low-latency mode
    against the local masked reference. Needs deep_ep and one GPU per rank."""
    from moe_runtime_deepep.backend import release_buffers

    device = torch.device("cuda", rank)
    p = problem(num_experts=8 * world, top_k=8, hidden=2048, inter=256)
    gw = global_weights(p).to(device)
    lw = local_weights(gw, rank, world)
    hidden, ids, w = (t.to(device) for t in tokens(p, n_tokens[rank], rank))
    settings = DeepEPSettings()
    results = {}

    setup = CommSetup(problem=p, payload=F.UNQUANTIZED, layout=F.TOKEN_MAJOR, ep_rank=rank,
                      ep_size=world, device=str(device), group=dist.group.WORLD)
    comm = DeepEPComm(setup=setup, settings=settings)
    ref = TorchAllToAll(setup=setup)
    ex = experts(p, rank, world, F.TOKEN_MAJOR, F.UNQUANTIZED, lw)
    d, h = ref.dispatch(hidden, ids, w)
    want = ref.combine(ex.forward(d), h)
    d, h = comm.dispatch(hidden, ids, w)
    got = comm.combine(ex.forward(d), h)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    results["normal"] = True

    setup = CommSetup(problem=p, payload=F.UNQUANTIZED, layout=F.MASKED, ep_rank=rank,
                      ep_size=world, device=str(device), group=dist.group.WORLD,
                      max_tokens_per_rank=max_tokens)
    comm = DeepEPComm(setup=setup, settings=settings)
    ex = experts(p, rank, world, F.MASKED, F.UNQUANTIZED, lw)
    want = reference_local_masked(p, hidden.cpu(), ids.cpu(), w.cpu())
    d, h = comm.dispatch(hidden, ids, w)
    got = comm.combine(ex.forward(d), h)
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=1.6e-2, atol=1e-3)
    results["low_latency"] = True
    release_buffers()
    return results
