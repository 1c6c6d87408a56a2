"""Deliberately wrong backends, each wrong in one declared respect (the suite must fail them).

Each is a subclass of the reference backend that changes one thing; the conformance test
installs each as its own plugin distribution."""

import attrs

from moe_runtime.backends.local import LocalComm
from moe_runtime.backends.reference import ReferenceExperts


class ScaledOutput(ReferenceExperts):
    """Every output 1% too large: a systematic error inside the old per-format tolerances."""

    def forward(self, d):
        return super().forward(d) * 1.01


class DroppedRemainderColumns(ReferenceExperts):
    """Declares any hidden size but computes only the columns up to the last multiple of 16."""

    def forward(self, d):
        out = super().forward(d).clone()
        keep = out.shape[-1] // 16 * 16
        out[..., keep:] = 0
        return out


class WrongBlockScale(ReferenceExperts):
    """NVFP4 block scales read one block off (each row's scales rotated by one)."""

    def prepare(self, weights):
        if weights.w13_scale is not None and weights.w13_scale.dim() == 3:
            weights = attrs.evolve(weights, w13_scale=weights.w13_scale.roll(1, dims=-1),
                                   w2_scale=weights.w2_scale.roll(1, dims=-1))
        super().prepare(weights)


class IgnoredRoutingWeights(ReferenceExperts):
    """Averages a token's experts instead of weighting them by the router."""

    def forward(self, d):
        if d.topk_weights is not None:
            valid = (d.topk_ids >= 0).float()
            d = attrs.evolve(d, topk_weights=valid / valid.sum(-1, keepdim=True).clamp(min=1))
        return super().forward(d)


class WrongActivation(ReferenceExperts):
    """Declares gelu, runs silu for every layer."""

    def prepare(self, weights):
        super().prepare(attrs.evolve(weights, activation="silu"))


class ShortComm(LocalComm):
    """Declares 128 tokens per rank, carries 64: the rest come back as zeros."""

    CARRIES = 64

    def combine(self, expert_out, handle):
        out = super().combine(expert_out, handle).clone()
        out[self.CARRIES:] = 0
        return out


class WrongDtype(ReferenceExperts):
    """Right numbers in float32, where ``Dispatched.out_dtype`` asks for the model's dtype."""

    def forward(self, d):
        return super().forward(d).float()


class MutatesHidden(ReferenceExperts):
    """Right output, but it scribbles over the dispatched hidden states it was given."""

    def forward(self, d):
        out = super().forward(d)
        d.hidden.mul_(0.5)
        return out


class ScalesWeightsInPlace(ReferenceExperts):
    """Doubles the checkpoint's gate/up weights in place in ``prepare`` and computes with them: the
    weights are the engine's, and a reference that reads the same tensors would agree with it."""

    def prepare(self, weights):
        weights.w13.mul_(2)
        super().prepare(weights)


class ExpertsPastEightWrong(ReferenceExperts):
    """Right for experts 0-7; expert e >= 8 is computed with expert e % 8's weights."""

    def forward(self, d):
        if d.topk_ids is not None:
            ids = d.topk_ids
            d = attrs.evolve(d, topk_ids=ids.where(ids < 8, ids % 8))
        return super().forward(d)


class RaisesOnMasked(ReferenceExperts):
    """Declares the masked layout, has not written it yet."""

    def forward(self, d):
        if d.layout == "masked":
            raise NotImplementedError("masked layout is not written yet")
        return super().forward(d)


class RenormalizedWeights(ReferenceExperts):
    """Renormalizes each token's routing weights to sum to 1 (a kernel's baked-in renormalize)."""

    def forward(self, d):
        if d.topk_weights is not None:
            w = d.topk_weights
            d = attrs.evolve(d, topk_weights=w / w.sum(-1, keepdim=True))
        return super().forward(d)


class DropsRowsPastTile(ReferenceExperts):
    """An expert's rows past its 256th are dropped (a per-expert tile limit)."""

    def forward(self, d):
        if d.layout == "masked":
            out = super().forward(d).clone()
            out[:, 256:] = 0
            return out
        ids = d.topk_ids.clone()
        flat = ids.reshape(-1)
        for e in flat.unique().tolist():
            if e >= 0:
                flat[(flat == e).nonzero().flatten()[256:]] = -1
        return super().forward(attrs.evolve(d, topk_ids=ids))


class TanhGelu(ReferenceExperts):
    """GELU by its tanh approximation, where the declaration promises the exact (erf) GELU."""

    def forward(self, d):
        import torch.nn.functional as F_nn

        from moe_runtime import reference_math

        exact = reference_math._activate

        def tanh_gelu(gate, activation):
            if activation == "gelu":
                return F_nn.gelu(gate, approximate="tanh")
            return exact(gate, activation)

        reference_math._activate = tanh_gelu
        try:
            return super().forward(d)
        finally:
            reference_math._activate = exact


class _ZeroRowsPast(ReferenceExperts):
    """Token-major rows from ``LIMIT`` on come back as zeros (a fixed workspace of ``LIMIT`` rows)."""

    LIMIT = 0

    def forward(self, d):
        out = super().forward(d)
        if d.hidden.shape[0] > self.LIMIT:
            out = out.clone()
            out[self.LIMIT:] = 0
        return out


class BreaksAbove64(_ZeroRowsPast):
    """Right up to 64 tokens, wrong past them: honest when it declares a bound of 64."""

    LIMIT = 64


class BreaksAt64(_ZeroRowsPast):
    """Declares a bound of 64 but holds 63 rows: the 64th token of a 64-token batch is lost."""

    LIMIT = 63


class BreaksAbove512(_ZeroRowsPast):
    """Declares no token bound, but rows past 512 come back as zeros."""

    LIMIT = 512


class BreaksAbove2048(_ZeroRowsPast):
    """Declares no token bound, but holds a fixed workspace of 2048 rows: the planner's default
    deployment sends 4096 tokens a forward."""

    LIMIT = 2048


class LocalIdsShiftedAgain(ReferenceExperts):
    """Treats the dispatched (already local) expert ids as global ones and subtracts this rank's
    first expert: right on rank 0, wrong on every other rank."""

    def forward(self, d):
        if d.topk_ids is not None and self.setup.first_local_expert:
            off = self.setup.first_local_expert
            ids = d.topk_ids
            shifted = ids - off
            # ids that fall outside the local range count as remote (-1), as such a kernel skips them
            shifted = shifted.masked_fill((ids < 0) | (shifted < 0), -1)
            d = attrs.evolve(d, topk_ids=shifted)
        return super().forward(d)


class ModelDtypeAccumulation(ReferenceExperts):
    """Both GEMMs accumulate in the model dtype: the running sum is rounded to bf16 / fp16 after
    every 16 columns of the reduction (an MMA with a 16-bit accumulator), not kept in float32."""

    STEP = 16

    def forward(self, d):
        import torch

        exact_mm = torch.Tensor.__matmul__
        dtype = d.out_dtype or torch.bfloat16
        step = self.STEP

        def rounded_mm(a, b):
            k = a.shape[-1]
            if k <= step or not a.is_floating_point():
                return exact_mm(a, b)
            acc = None
            for k0 in range(0, k, step):
                part = exact_mm(a[..., k0:k0 + step].float(), b[k0:k0 + step].float())
                acc = part if acc is None else acc.float() + part
                acc = acc.to(dtype)
            return acc.to(torch.promote_types(a.dtype, b.dtype))

        torch.Tensor.__matmul__ = rounded_mm
        try:
            return super().forward(d)
        finally:
            torch.Tensor.__matmul__ = exact_mm


class RoutingKeptFromFirstForward(ReferenceExperts):
    """Keeps the routing of its first forward (a grouping computed once, as decode batches look
    alike): later forwards reuse it for the tokens the first one had. Right on an instance's
    first forward, which is all the suite ran."""

    def forward(self, d):
        if d.topk_ids is not None:
            kept = getattr(self, "_first_ids", None)
            if kept is None:
                self._first_ids = kept = d.topk_ids.clone()
            m = min(kept.shape[0], d.topk_ids.shape[0])
            ids = d.topk_ids.clone()
            ids[:m] = kept[:m]
            d = attrs.evolve(d, topk_ids=ids)
        return super().forward(d)


_PREPARED_BY_SHAPE = {}


class WeightsCachedByShape(ReferenceExperts):
    """Caches prepared weights in the module, keyed by the layer's shape (a second model load is
    free): every layer of one shape computes with the first one's weights. One case per process
    passed; the next case of that shape failed, and its replay alone passed."""

    def prepare(self, weights):
        key = (weights.format, weights.activation, tuple(weights.w13.shape),
               tuple(weights.w2.shape), self.setup.layout)
        super().prepare(_PREPARED_BY_SHAPE.setdefault(key, weights))


class WeightsOnTheClass(ReferenceExperts):
    """Keeps the prepared weights on the class (one copy for every layer): each instance computes
    with the weights of the last layer prepared."""

    def prepare(self, weights):
        super().prepare(weights)
        type(self).weights = self.__dict__.pop("weights")


class ExpertsByGlobalId(ReferenceExperts):
    """Keeps its experts in a table indexed by global expert id (other ranks' rows zero) and adds
    ``first_local_expert`` to the dispatched local ids; the masked path forgets that: block ``e``
    is read at row ``e``, another rank's expert on every rank but the first (16-bit formats)."""

    def prepare(self, weights):
        super().prepare(weights)
        first, local = self.setup.first_local_expert, weights.num_experts
        total = self.setup.problem.num_experts

        def table(t):
            out = t.new_zeros((total, *t.shape[1:]))
            out[first:first + local] = t
            return out

        self.weights = attrs.evolve(weights, w13=table(weights.w13), w2=table(weights.w2))

    def forward(self, d):
        if d.topk_ids is not None:
            first = self.setup.first_local_expert
            d = attrs.evolve(d, topk_ids=d.topk_ids.where(d.topk_ids < 0, d.topk_ids + first))
            return super().forward(d)
        table, local = self.weights, d.hidden.shape[0]
        self.weights = attrs.evolve(table, w13=table.w13[:local], w2=table.w2[:local])  # rows 0..
        try:
            return super().forward(d)
        finally:
            self.weights = table


class ZeroesWeightsAfterForward(ReferenceExperts):
    """Right output, but its first forward zeroes the checkpoint's weights it kept from
    ``prepare`` ("staged already, nothing reads them again"): the engine's tensors, and the
    reference run after it read them too."""

    def forward(self, d):
        import torch

        out = super().forward(d)
        exact = self.weights
        self.weights = attrs.evolve(exact, w13=exact.w13.clone(), w2=exact.w2.clone())
        with torch.no_grad():
            exact.w13.zero_()
            exact.w2.zero_()
        return out


class OutputInFloat16(ReferenceExperts):
    """Keeps its output in float16 whatever the model's dtype (a float16 epilogue): right on the
    usual N(0, 1) inputs, inf where bf16 activations are large (float16's largest is 65504)."""

    def forward(self, d):
        import torch

        out = super().forward(d)
        return out.to(torch.float16).to(out.dtype)


class BreaksAbove4096(_ZeroRowsPast):
    """Declares no token bound, but holds 4096 rows: right at the default deployment's batch,
    wrong past it."""

    LIMIT = 4096


class SyncsWithTheHost(ReferenceExperts):
    """Declares cuda_graphs=True but reads a value to the host in every forward (.item())."""

    def forward(self, d):
        _ = float(d.hidden.float().sum().item())
        return super().forward(d)


class RemoteSlotsAsExpertZero(ReferenceExperts):
    """Clamps the ``-1`` (remote) slots to expert 0: wrong, and without any state."""

    def forward(self, d):
        if d.topk_ids is not None:
            d = attrs.evolve(d, topk_ids=d.topk_ids.clamp_min(0))
        return super().forward(d)


class MaskedFirstExpertsCount(ReferenceExperts):
    """Masked: reads ``masked_m[0]`` as every expert's row count (no state; wrong for some expert
    orders only)."""

    def forward(self, d):
        if d.masked_m is not None:
            d = attrs.evolve(d, masked_m=d.masked_m[:1].expand_as(d.masked_m).clone())
        return super().forward(d)


class RandomOutput(ReferenceExperts):
    """Random numbers of the right shape and dtype (no state)."""

    def forward(self, d):
        import torch

        out = super().forward(d)
        return torch.randn(out.shape).to(out.dtype)


class WrongFrom600To4095Tokens(ReferenceExperts):
    """Declares no token bound, right up to 599 tokens and from 4096 on, 1% off in between (a
    mid-sized path of its own, wrong)."""

    def forward(self, d):
        out = super().forward(d)
        if 600 <= d.hidden.shape[0] < 4096:
            out = out * 1.01
        return out


class FixedWidthBuffer(ReferenceExperts):
    """Holds at most 4096 hidden columns and 4096 intermediate columns (a fixed-width buffer):
    past them the output's extra columns are zeros and the intermediate's are dropped."""

    WIDTH = 4096

    def prepare(self, weights):
        I = weights.w2.shape[-1] if weights.w2.dim() == 3 else None
        if I is not None and weights.w13.dtype.is_floating_point and I > self.WIDTH:
            w2 = weights.w2.clone()
            w2[..., self.WIDTH:] = 0  # the intermediate past the buffer never reaches GEMM 2
            weights = attrs.evolve(weights, w2=w2)
        super().prepare(weights)

    def forward(self, d):
        out = super().forward(d)
        if out.shape[-1] > self.WIDTH:
            out = out.clone()
            out[..., self.WIDTH:] = 0
        return out
