"""The batched sampler: greedy, transformers' filters, counter-based seeds, logprobs, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moe_runtime.serve.sampling import (
    GREEDY,
    BatchSampler,
    SamplingError,
    SamplingParams,
    processor_list,
    splitmix64,
)

V = 64


def _logits(steps: int, rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(steps, rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _step(sampler, keys, logits) -> list[int]:
    rows = sampler.rows_for(keys)
    tokens = sampler.sample(logits, rows).tolist()
    sampler.collect()
    return tokens


def test_splitmix64_wraps_like_the_reference():
    def reference(x):
        m = 2**64 - 1
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & m
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & m
        return x ^ (x >> 31)

    values = [0, 1, 12345, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
    got = [v % 2**64 for v in splitmix64(signed).tolist()]
    assert got == [reference(v) for v in values]


def test_greedy_rows_take_the_argmax_and_no_slot():
    s = BatchSampler(V, max_slots=4, max_batch=8)
    assert s.open(SamplingParams(temperature=0.0, seed=5)) == GREEDY
    assert s.open(SamplingParams(top_k=1)) == GREEDY
    assert s.open_slots == 0
    sampled = s.open(SamplingParams(temperature=1.0, seed=3))
    for logits in _logits(5, rows=4):
        tokens = _step(s, [GREEDY, sampled, GREEDY, GREEDY], logits)
        assert [tokens[i] for i in (0, 2, 3)] == logits[[0, 2, 3]].argmax(-1).tolist()


def test_a_greedy_request_with_penalties_takes_the_penalized_argmax():
    s = BatchSampler(V, max_slots=2, max_batch=2)
    key = s.open(SamplingParams(temperature=0.0, frequency_penalty=100.0))
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9] = 5.0, 4.0
    assert _step(s, [key], logits) == [7]
    assert _step(s, [key], logits) == [9]  # 7 was generated once: 5 - 100 < 4


PARAMS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=0.9, top_p=0.6, seed=3),
    SamplingParams(temperature=1.0, min_p=0.2, seed=4),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=5),
    SamplingParams(temperature=1.1, repetition_penalty=1.8, top_p=0.95, seed=6),
]


def _transformers_filtered(p: SamplingParams, input_ids: list[int], logits: torch.Tensor):
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        procs.append(MinPLogitsWarper(p.min_p))
    ids = torch.tensor([input_ids or [0]])
    return procs(ids, logits[None].clone())[0]


def test_filtered_distributions_equal_transformers_processors_in_one_batch():
    s = BatchSampler(V, max_slots=8, max_batch=8)
    prompts = [list(range(i, 40, 3 + i)) for i in range(len(PARAMS))]
    keys = [s.open(p, prompt) for p, prompt in zip(PARAMS, prompts, strict=True)]
    generated = [[] for _ in PARAMS]
    for logits in _logits(6, rows=len(PARAMS), seed=11):
        rows = s.rows_for(keys)
        mine = s.filtered_logits(logits, rows)
        for i, p in enumerate(PARAMS):
            ref = _transformers_filtered(p, prompts[i] + generated[i], logits[i])
            assert torch.equal(torch.isinf(mine[i]), torch.isinf(ref)), p
            assert torch.allclose(mine[i].softmax(-1), ref.softmax(-1), atol=1e-6), p
        tokens = s.sample(logits, rows).tolist()
        for i, t in enumerate(tokens):
            assert not torch.isinf(mine[i, t]), "a filtered token was drawn"
            generated[i].append(t)
    assert any(torch.isinf(mine[i]).any() for i in range(1, len(PARAMS)))


def test_presence_and_frequency_penalties_follow_openais_definition():
    s = BatchSampler(V, max_slots=2, max_batch=2)
    key = s.open(SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25,
                                seed=9))
    counts = torch.zeros(V)
    for logits in _logits(8, seed=2):
        rows = s.rows_for([key])
        want = logits[0] - 0.25 * counts - 0.5 * (counts > 0).float()
        assert torch.allclose(s.filtered_logits(logits, rows)[0], want)
        counts[s.sample(logits, rows).item()] += 1


def _run_alone(params, logits):
    s = BatchSampler(V, max_slots=4, max_batch=4)
    key = s.open(params)
    return [_step(s, [key], step[:1])[0] for step in logits]


def test_a_seeded_request_draws_the_same_tokens_alone_or_batched_in_any_row():
    logits = _logits(12, rows=1, seed=3)
    params = [SamplingParams(temperature=1.0, seed=seed, top_p=0.95) for seed in (1, 2, 3)]
    alone = [_run_alone(p, logits) for p in params]
    s = BatchSampler(V, max_slots=8, max_batch=8)
    s.open(SamplingParams(temperature=1.0, seed=99))  # holds a row, not in these batches
    keys = [s.open(p) for p in params]
    together = [[], [], []]
    for i, step in enumerate(logits):
        order = [(i + j) % 3 for j in range(3)]  # the rows change every step
        picked = _step(s, [keys[j] for j in order] + [GREEDY], step.expand(4, V))
        for j, tok in zip(order, picked[:3], strict=True):
            together[j].append(tok)
        assert picked[3] == int(step[0].argmax())
    assert together == alone
    assert alone[0] != alone[1] != alone[2]  # different seeds, different draws


def test_a_stage_run_for_every_row_changes_no_token():
    logits = _logits(10, rows=2, seed=5)
    params = [SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=0.0)]
    results = []
    for static in (False, True):
        s = BatchSampler(V, max_slots=4, max_batch=4, static=static)
        keys = [s.open(p) for p in params]
        results.append([_step(s, keys, step) for step in logits])
    assert results[0] == results[1]


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0] + [-50.0] * (V - 6)])
    probs = logits[0].softmax(-1)
    n = 4000
    s = BatchSampler(V, max_slots=4, max_batch=4)
    seen = torch.zeros(V)
    for seed in range(n):
        key = s.open(SamplingParams(temperature=1.0, seed=seed))
        seen[_step(s, [key], logits)[0]] += 1
        s.close(key)
    for t in range(5):  # each within 5 standard deviations of its expected count
        sd = math.sqrt(n * probs[t] * (1 - probs[t]))
        assert abs(seen[t] - n * probs[t]) < 5 * sd, (t, seen[t], n * probs[t])
    top = BatchSampler(V, max_slots=2, max_batch=2)
    key = top.open(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {_step(top, [key], logits)[0] for _ in range(200)} == {0, 1}


def test_logprobs_are_the_models_own_and_recorded_per_request():
    s = BatchSampler(V, max_slots=4, max_batch=4)
    key = s.open(SamplingParams(temperature=0.0, logprobs=3))
    other = s.open(SamplingParams(temperature=1.0, seed=1))
    logits = _logits(3, rows=2, seed=8)
    tokens = [_step(s, [other, key], step)[1] for step in logits]
    records = s.records(key)
    assert [r.token for r in records] == tokens
    for r, step in zip(records, logits, strict=True):
        logp = step[1].log_softmax(-1)
        assert r.logprob == pytest.approx(float(logp[r.token]), abs=1e-5)
        assert [t for t, _ in r.top] == logp.topk(3).indices.tolist()
    assert s.records(other) == []


def test_rows_return_to_the_pool_and_open_refuses_more_than_max_slots():
    s = BatchSampler(V, max_slots=2, max_batch=4)
    rooms = []
    s.on_room = lambda: rooms.append(1)
    logits = _logits(1, rows=3)[0]
    keys = [s.open(SamplingParams(temperature=1.0, seed=i)) for i in range(2)]
    assert s.open(SamplingParams(temperature=1.0, seed=2)) is None and not s.has_room
    assert s.open(SamplingParams(temperature=0.0)) == GREEDY  # greedy ones need no row
    _step(s, keys, logits[:2])
    s.release(keys[0])  # its last token: room for one more, its records kept until close
    assert rooms == [1] and s.has_room
    third = s.open(SamplingParams(temperature=1.0, seed=2))
    assert third is not None and s.open(SamplingParams(temperature=1.0)) is None
    _step(s, [keys[1], third], logits[:2])  # the released row went to the third
    s.close(keys[0])  # closing after release gives no second room
    assert rooms == [1] and s.open_slots == 2
    s.close(keys[1])  # closing one never released gives its room back
    assert rooms == [1, 1] and s.has_room
    s.close(third)
    assert s.open_slots == 0


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -0.1, "temperature must be 0"),
    ("temperature", float("nan"), "finite"),
    ("top_p", 0.0, "top_p must lie in (0, 1]"),
    ("top_k", -2, "top_k must be an integer"),
    ("min_p", 1.5, "min_p must lie in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be above 0"),
    ("logprobs", 21, "logprobs must be None or an integer in [0, 20]"),
    ("seed", 1.5, "seed must be an integer or None"),
])
def test_bad_parameters_are_refused_by_name(field, value, words):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**{field: value})
    assert words in str(err.value)


def test_seeds_are_taken_modulo_2_to_the_64():
    logits = _logits(6, seed=4)
    wrapped, plain = (_run_alone(SamplingParams(temperature=1.0, seed=s), logits)
                      for s in (2**64 + 5, 5))
    assert wrapped == plain


def test_logits_of_another_shape_are_refused():
    s = BatchSampler(V, max_slots=2, max_batch=2)
    with pytest.raises(SamplingError, match="made for 64 columns and at most 2 rows"):
        s.sample(torch.zeros(3, V), torch.zeros(3, dtype=torch.int32))


class _Req:
    def __init__(self, key):
        self.has_new_token = True
        self.state = type("S", (), {"logit_processor_kwargs":
                                    {} if key == GREEDY else {"moe_runtime_sampling_slot": key}})


def test_the_continuous_batching_list_points_padding_rows_at_the_scratch_row():
    s = BatchSampler(V, max_slots=4, max_batch=8)
    procs = processor_list(s)
    key = s.open(SamplingParams(temperature=1.0, seed=3))
    # what an earlier step left there
    storage = torch.full((procs.tensors_required, 8), 3, dtype=torch.int32)
    procs.prepare_tensor_args([_Req(key), _Req(GREEDY)], storage)
    assert storage[0, 1:].tolist() == [0] * 7 and storage[0, 0] > 0
    logits = _logits(1, rows=4)[0]
    scores = procs(None, logits.clone(), storage[:, :4])
    tokens = scores.argmax(-1)
    assert (scores.isfinite().sum(-1) == 1).all()
    assert tokens[1:].tolist() == logits[1:].argmax(-1).tolist()


def test_the_api_never_asks_for_more_alternatives_than_the_sampler_records():
    from moe_runtime.serve import protocol, sampling

    assert protocol.MAX_LOGPROBS <= sampling.MAX_LOGPROBS
    # and no more stop tokens than the engine's sampler masks for min_tokens
    assert protocol.MAX_STOP_TOKEN_IDS <= sampling.MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_a_temperature_near_zero_is_greedy(temperature):
    # float32 logits divided by such a temperature overflow to inf; the draw must not then pick
    # among the infinite logits (it took the least likely positive one)
    logits = _logits(4, seed=6)
    s = BatchSampler(V, max_slots=2, max_batch=2)
    key = s.open(SamplingParams(temperature=temperature, seed=1))
    assert key == GREEDY
    assert [_step(s, [key], step)[0] for step in logits] == logits[:, 0].argmax(-1).tolist()


def _run_steps(params, logits, pipelined: bool):
    """Steps through the continuous-batching list as transformers drives it: each step prepared
    (rows_for), then sampled; collected right after (synchronous batching) or only after the
    next step has been prepared and sampled too (asynchronous batching, two argument storages
    alternating like its two IO pairs). Returns each request's tokens and records."""
    s = BatchSampler(V, max_slots=4, max_batch=4)
    if pipelined:
        s.pipeline(2)
    procs = processor_list(s)
    keys = [s.open(p) for p in params]
    storages = [torch.zeros((procs.tensors_required, 4), dtype=torch.int32) for _ in range(2)]
    tokens = {i: [] for i in range(len(keys))}
    in_flight = []
    for n, step in enumerate(logits):
        storage = storages[n % 2]
        procs.prepare_tensor_args([_Req(k) for k in keys], storage)
        scores = procs(None, step.clone(), storage[:, :len(keys)])
        in_flight.append(scores.argmax(-1).tolist())
        if not pipelined or len(in_flight) == 2:
            s.collect()
            for i, t in enumerate(in_flight.pop(0)):
                tokens[i].append(t)
    for done in in_flight:
        s.collect()
        for i, t in enumerate(done):
            tokens[i].append(t)
    return [tokens[i] for i in range(len(keys))], [s.records(k) for k in keys]


def test_asynchronous_batching_order_gives_the_same_tokens_and_logprobs():
    # step N+1 is prepared and sampled before step N's log-probabilities are collected: each
    # step's records must still be its own (one buffer per step in flight)
    params = [SamplingParams(temperature=0.0, logprobs=4),
              SamplingParams(temperature=0.9, seed=11, logprobs=2),
              SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.3)]
    logits = _logits(6, rows=3, seed=21)
    sync_tokens, sync_records = _run_steps(params, logits, pipelined=False)
    async_tokens, async_records = _run_steps(params, logits, pipelined=True)
    assert async_tokens == sync_tokens
    assert [len(r) for r in async_records] == [6, 6, 0]
    assert async_records == sync_records
    for r, step, token in zip(async_records[0], logits, sync_tokens[0], strict=True):
        assert r.token == token
        assert r.logprob == pytest.approx(float(step[0].log_softmax(-1)[token]), abs=1e-5)


def test_a_pipelined_step_collected_late_reads_its_own_buffer_not_the_next_ones():
    # without the second buffer the next step's sample would overwrite this step's records
    s = BatchSampler(V, max_slots=2, max_batch=2)
    s.pipeline(2)
    key = s.open(SamplingParams(temperature=0.0, logprobs=1))
    first, second = _logits(2, rows=1, seed=3)
    t1 = s.sample(first, s.rows_for([key])).item()
    t2 = s.sample(second, s.rows_for([key])).item()
    s.collect()
    assert [r.token for r in s.records(key)] == [t1]
    assert s.records(key)[0].logprob == pytest.approx(float(first[0].log_softmax(-1)[t1]),
                                                      abs=1e-5)
    s.collect()
    assert [r.token for r in s.records(key)] == [t1, t2]
    s.collect()  # nothing left: no record made up
    assert len(s.records(key)) == 2


def test_a_row_reused_while_its_last_step_is_in_flight_starts_the_new_request_afresh():
    # asynchronous batching, transformers 5.17's order: step N+1 is prepared and launched
    # before step N is collected; a request that finished in step 0 is computed once more in
    # step 1 (that token dropped: collected as skipped); its row, released when step 0's
    # tokens are delivered, goes to a new request prepared in step 2, before step 1 is
    # collected. The new request's draws must be those it makes alone: the skipped step of
    # the finished request must not be undone on the row it no longer holds.
    params = SamplingParams(temperature=1.0, seed=77, repetition_penalty=1.2)
    logits = _logits(8, rows=1, seed=9)
    alone = _run_alone(params, logits[2:])
    s = BatchSampler(V, max_slots=1, max_batch=1)
    s.pipeline(2)
    first = s.open(SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.2))
    s.sample(logits[0], s.rows_for([first]))  # step 0
    s.sample(logits[1], s.rows_for([first]))  # step 1, launched before step 0 is collected
    s.collect()  # step 0: the request finished
    s.release(first)
    second = s.open(params)
    got = [s.sample(logits[2], s.rows_for([second])).item()]  # step 2 takes the row
    s.collect(skipped={0})  # step 1: the finished request's extra token, dropped
    for step in logits[3:]:
        got.append(s.sample(step, s.rows_for([second])).item())
        s.collect()
    assert got == alone


def test_a_step_dropped_for_a_request_that_keeps_its_row_is_undone():
    # asynchronous batching: a request offloaded while its step was in flight keeps its slot
    # and row, but the batcher drops that step's token; its position (the seed's counter),
    # token counts (penalties) and records must be as if the step never ran
    params = SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.5,
                            frequency_penalty=0.7, logprobs=2)
    logits = _logits(5, rows=1, seed=13)
    kept = [0, 2, 3, 4]  # step 1 is dropped
    ref = BatchSampler(V, max_slots=2, max_batch=2)
    key = ref.open(params)
    expected = [_step(ref, [key], logits[n])[0] for n in kept]
    s = BatchSampler(V, max_slots=2, max_batch=2)
    s.pipeline(2)
    key = s.open(params)
    got = [s.sample(logits[0], s.rows_for([key])).item()]
    s.sample(logits[1], s.rows_for([key]))
    s.collect()  # step 0
    s.collect(skipped={0})  # step 1: dropped
    for n in kept[1:]:
        got.append(s.sample(logits[n], s.rows_for([key])).item())
        s.collect()
    assert got == expected
    assert [r.token for r in s.records(key)] == expected == [r.token for r in ref.records(key)]


def test_the_log_probability_buffer_comes_from_the_step_arguments():
    # a replayed CUDA graph reads its buffer from the step's argument row, not from the
    # sampler's host state at capture: two steps prepared, then computed in turn
    s = BatchSampler(V, max_slots=2, max_batch=2)
    s.pipeline(2)
    procs = processor_list(s)
    key = s.open(SamplingParams(temperature=0.0, logprobs=1))
    storages = [torch.zeros((procs.tensors_required, 2), dtype=torch.int32) for _ in range(2)]
    steps = _logits(2, rows=1, seed=17)
    for storage in storages:
        procs.prepare_tensor_args([_Req(key)], storage)
    assert storages[0][1, 0] != storages[1][1, 0]
    tokens = [procs(None, step.clone(), storage[:, :1]).argmax(-1).item()
              for step, storage in zip(steps, storages, strict=True)]
    s.collect()
    s.collect()
    records = s.records(key)
    assert [r.token for r in records] == tokens
    for r, step in zip(records, steps, strict=True):
        assert r.logprob == pytest.approx(float(step[0].log_softmax(-1)[r.token]), abs=1e-5)


def test_one_step_at_a_time_writes_one_buffer():
    s = BatchSampler(V, max_slots=1, max_batch=1)
    for _ in range(3):
        s.rows_for([GREEDY])
        assert s.newest_buffer == 0
        s.collect()


def test_pipeline_depth_is_one_or_two():
    s = BatchSampler(V, max_slots=1, max_batch=1)
    with pytest.raises(SamplingError, match="pipeline depth 3: 1 or 2"):
        s.pipeline(3)
