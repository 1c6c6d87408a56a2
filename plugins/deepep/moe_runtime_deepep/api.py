"""Which DeepEP ``Buffer`` API is installed, found from signatures and attributes (never a name).

Pure Python: :func:`inspect_buffer_api` takes the ``Buffer`` class (or any class with its methods,
such as the tests' simulation) and reports the features the backend relies on. The differences
between the releases read are tabled in README.md, "DeepEP API versions".
"""

from __future__ import annotations

import inspect

import attrs


def _params(obj, name: str) -> frozenset[str]:
    fn = getattr(obj, name, None)
    if fn is None:
        return frozenset()
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a C function without a signature
        return frozenset()
    return frozenset(sig.parameters)


@attrs.frozen
class BufferApi:
    """Features of one ``Buffer`` class.

    :param ll_unquantized: ``low_latency_dispatch`` takes ``use_fp8`` and can therefore carry bf16
        (1.0.0 always casts to FP8 with per-token 128-channel scales).
    :param ll_nvfp4: ``low_latency_dispatch`` takes ``use_nvfp4`` and ``x_global_scale`` (a fork).
    :param nvlink_for_low_latency: ``Buffer`` takes ``allow_nvlink_for_low_latency_mode``.
    :param sm90_query: ``Buffer.is_sm90_compiled`` exists (builds without SM90 features have no
        FP8).
    :param normal_dispatch: ``dispatch`` and ``get_dispatch_layout`` take the keywords used here.
    :param low_latency: ``low_latency_dispatch`` and ``low_latency_combine`` exist.
    """

    ll_unquantized: bool
    ll_nvfp4: bool
    nvlink_for_low_latency: bool
    sm90_query: bool
    normal_dispatch: bool
    low_latency: bool
    init_params: frozenset[str] = frozenset()

    def describe(self) -> str:
        feats = [name for name in ("ll_unquantized", "ll_nvfp4", "nvlink_for_low_latency",
                                   "sm90_query", "normal_dispatch", "low_latency")
                 if getattr(self, name)]
        return ", ".join(feats) or "none of the features this plugin uses"


_NORMAL_KEYWORDS = frozenset({
    "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
    "num_tokens_per_expert", "topk_idx", "topk_weights",
})


def inspect_buffer_api(buffer_cls) -> BufferApi:
    """The features of ``buffer_cls`` (``deep_ep.Buffer`` or a stand-in with the same methods)."""
    ll_dispatch = _params(buffer_cls, "low_latency_dispatch")
    ll_combine = _params(buffer_cls, "low_latency_combine")
    dispatch = _params(buffer_cls, "dispatch")
    layout = _params(buffer_cls, "get_dispatch_layout")
    init = _params(buffer_cls, "__init__")
    return BufferApi(
        ll_unquantized="use_fp8" in ll_dispatch,
        ll_nvfp4={"use_nvfp4", "x_global_scale"} <= ll_dispatch,
        nvlink_for_low_latency="allow_nvlink_for_low_latency_mode" in init,
        sm90_query=callable(getattr(buffer_cls, "is_sm90_compiled", None)),
        normal_dispatch=_NORMAL_KEYWORDS <= dispatch and {"topk_idx", "num_experts"} <= layout,
        low_latency=bool(ll_dispatch) and bool(ll_combine),
        init_params=init,
    )
