"""The plugin's settings: environment variables, validated when read, the same on every rank.

Pure Python. The declared low-latency token bound is read when the plugin registers; the run-time
policies when a backend is built. The variables are listed in README.md, "Settings".
"""

from __future__ import annotations

import os

import attrs

from moe_runtime_deepep import limits

ENV_LL_MAX_TOKENS = "MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK"
ENV_LL_OVERSIZE = "MOE_RUNTIME_DEEPEP_LL_OVERSIZE"
ENV_LL_SPLIT_MAX_TOKENS = "MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK"
#: Read only to refuse it: the per-forward agreement on batch sizes (an all-reduce and a host sync
#: in every low-latency forward) was removed; bounds are fixed at start-up instead.
ENV_AGREE_REMOVED = "MOE_RUNTIME_DEEPEP_AGREE_ON_BATCH"
ENV_NUM_SMS = "MOE_RUNTIME_DEEPEP_NUM_SMS"
ENV_ALLOW_NVLINK_LL = "MOE_RUNTIME_DEEPEP_ALLOW_NVLINK_LL"
ENV_LL_HIDDEN_SIZES = "MOE_RUNTIME_DEEPEP_LL_HIDDEN_SIZES"
ENV_QP_DEPTH = "NVSHMEM_QP_DEPTH"  # DeepEP's own variable, read to check the bound against it

OVERSIZE_POLICIES = ("refuse", "split")


class SettingsError(ValueError):
    """A setting of the DeepEP plugin is invalid; the message names the variable."""


def _int(environ, name: str, default: int | None, *, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise SettingsError(f"{name}={value} must be at least {minimum}")
    return value


def _bool(environ, name: str, default: bool | None) -> bool | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


@attrs.frozen
class DeepEPSettings:
    """The plugin's settings (README.md, "Settings", lists the variables).

    :param ll_max_tokens_per_rank: tokens per rank of one low-latency call (DeepEP's
        ``num_max_dispatch_tokens_per_rank``); the low-latency mode's declared bound under
        ``refuse``.
    :param ll_oversize: ``refuse`` a batch above that bound, or ``split`` batches of up to
        ``ll_split_max_tokens_per_rank`` into a fixed number of bounded rounds.
    :param ll_split_max_tokens_per_rank: under ``split``, the low-latency mode's declared bound:
        every forward runs ``ceil(it / ll_max_tokens_per_rank)`` rounds on every rank, a number
        every rank knows at start-up, so no forward has to agree on it.
    """

    ll_max_tokens_per_rank: int = limits.DEFAULT_LOW_LATENCY_MAX_TOKENS_PER_RANK
    ll_oversize: str = "refuse"
    ll_split_max_tokens_per_rank: int | None = None
    num_sms: int | None = None
    allow_nvlink_for_low_latency: bool | None = None
    ll_hidden_sizes: tuple[int, ...] = limits.LOW_LATENCY_HIDDEN_SIZES
    qp_depth: int = limits.DEFAULT_NVSHMEM_QP_DEPTH

    def __attrs_post_init__(self) -> None:
        if self.ll_oversize not in OVERSIZE_POLICIES:
            raise SettingsError(
                f"{ENV_LL_OVERSIZE}={self.ll_oversize!r}: use one of {', '.join(OVERSIZE_POLICIES)}"
            )
        self._check_split()
        limit = limits.max_low_latency_tokens(self.qp_depth)
        if not 1 <= self.ll_max_tokens_per_rank <= limit:
            raise SettingsError(
                f"{ENV_LL_MAX_TOKENS}={self.ll_max_tokens_per_rank}: DeepEP's low-latency calls "
                f"assert {ENV_QP_DEPTH} >= (bound + 1) * 2, so with {ENV_QP_DEPTH}={self.qp_depth} "
                f"the bound must be between 1 and {limit}"
            )
        if self.num_sms is not None and self.num_sms % 2:
            raise SettingsError(f"{ENV_NUM_SMS}={self.num_sms}: DeepEP needs an even SM count")

    def _check_split(self) -> None:
        split_max = self.ll_split_max_tokens_per_rank
        if self.ll_oversize == "split" and split_max is None:
            raise SettingsError(
                f"{ENV_LL_OVERSIZE}=split needs {ENV_LL_SPLIT_MAX_TOKENS}: the largest batch per "
                "rank a forward sends (the engine's max tokens per forward). Every rank runs "
                "ceil(it / bound) low-latency rounds in every forward, so the number of rounds is "
                "known on every rank without synchronising"
            )
        if self.ll_oversize != "split" and split_max is not None:
            raise SettingsError(
                f"{ENV_LL_SPLIT_MAX_TOKENS}={split_max} is read only with {ENV_LL_OVERSIZE}=split "
                f"(it is {self.ll_oversize!r}): set both, or neither"
            )
        if split_max is not None and split_max <= self.ll_max_tokens_per_rank:
            raise SettingsError(
                f"{ENV_LL_SPLIT_MAX_TOKENS}={split_max} must be above {ENV_LL_MAX_TOKENS}="
                f"{self.ll_max_tokens_per_rank} (one round already holds such batches: use "
                f"{ENV_LL_OVERSIZE}=refuse)"
            )

    @classmethod
    def from_env(cls, environ=None) -> DeepEPSettings:
        environ = os.environ if environ is None else environ
        sizes_raw = environ.get(ENV_LL_HIDDEN_SIZES, "").strip()
        if sizes_raw:
            try:
                sizes = tuple(sorted({int(s) for s in sizes_raw.split(",") if s.strip()}))
            except ValueError:
                raise SettingsError(
                    f"{ENV_LL_HIDDEN_SIZES}={sizes_raw!r} is not a comma list of integers"
                ) from None
        else:
            sizes = limits.LOW_LATENCY_HIDDEN_SIZES
        if _bool(environ, ENV_AGREE_REMOVED, False):
            raise SettingsError(
                f"{ENV_AGREE_REMOVED} is no longer read: a low-latency forward makes no "
                "per-forward agreement on batch sizes (that was an all-reduce and a host sync in "
                "every forward). A batch above the bound is refused by the rank that has it; "
                f"for bounded rounds set {ENV_LL_OVERSIZE}=split and {ENV_LL_SPLIT_MAX_TOKENS}. "
                "Unset it (or set 0)"
            )
        return cls(
            ll_max_tokens_per_rank=_int(environ, ENV_LL_MAX_TOKENS,
                                        limits.DEFAULT_LOW_LATENCY_MAX_TOKENS_PER_RANK, minimum=1),
            ll_oversize=environ.get(ENV_LL_OVERSIZE, "refuse").strip().lower() or "refuse",
            ll_split_max_tokens_per_rank=_int(environ, ENV_LL_SPLIT_MAX_TOKENS, None, minimum=2),
            num_sms=_int(environ, ENV_NUM_SMS, None, minimum=2),
            allow_nvlink_for_low_latency=_bool(environ, ENV_ALLOW_NVLINK_LL, None),
            ll_hidden_sizes=sizes,
            qp_depth=_int(environ, ENV_QP_DEPTH, limits.DEFAULT_NVSHMEM_QP_DEPTH, minimum=4),
        )
