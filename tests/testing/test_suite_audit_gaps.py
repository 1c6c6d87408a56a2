"""Gaps an outside audit found by writing wrong backends from the docs, closed in general (from the
declarations, never by a backend's name): large bf16 activations, an undeclared token bound past
4096 tokens, a ``cuda_graphs=True`` promise that a CPU run cannot check, failure messages that
claimed shared state without evidence, and a mistyped ``--case`` id that ran nothing and passed.

Like ``test_suite_has_teeth``, each backend is a real plugin distribution checked by
``moe-runtime conformance``; only the cases under test are selected (``-k``), to stay cheap.
"""

from __future__ import annotations

import collections
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moe_runtime.testing.cases import UNBOUNDED_CASE_TOKENS_PER_FORWARD, UNBOUNDED_PAST_CASE_TOKENS
from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

HERE = Path(__file__).parent / "backends"
BF16 = 'Support(formats=["bf16"], hardware=CPU)'
BOTH_LAYOUTS = 'Support(formats=["bf16"], layouts=["token_major", "masked"], hardware=CPU)'

# backend name -> (implementation class, declaration, keywords of the spec)
WRONG = {
    "gap_fp16_output": ("OutputInFloat16", 'Support(formats=["bf16", "fp16", "fp8_w8a8"], '
                        'payloads=["unquantized", "fp8"], hardware=CPU)', ""),
    "gap_past_4096": ("BreaksAbove4096", BF16, ""),
    "gap_graphs": ("SyncsWithTheHost", BF16, "cuda_graphs=True"),
    "gap_remote_zero": ("RemoteSlotsAsExpertZero", BF16, ""),
    "gap_masked_first": ("MaskedFirstExpertsCount", BOTH_LAYOUTS, ""),
    "gap_random": ("RandomOutput", BOTH_LAYOUTS, ""),
    # state the suite must still name: first prepared wins, last prepared wins, kept from a forward
    "gap_cached_by_shape": ("WeightsCachedByShape", BF16, ""),
    "gap_class_weights": ("WeightsOnTheClass", BOTH_LAYOUTS, ""),
    "gap_first_routing": ("RoutingKeptFromFirstForward", BF16, ""),
}
HONEST = ("HonestExperts", 'Support(formats=["bf16", "fp16", "fp8_w8a8", "nvfp4_w4a4"], '
          'activations=["silu", "gelu"], layouts=["token_major", "masked"], '
          'payloads=["unquantized", "fp8"], hardware=CPU)', "cuda_graphs=True")

PLUGIN = '''
    from moe_runtime import ExpertsBackendSpec, Hardware, Support, hookimpl

    CPU = Hardware(devices=["cpu"])

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="{name}", factory="{module}.impl:{cls}", priority=-5,
                                    supports=[{support}], {extra}))
'''

# the cases under test, and a few ordinary ones for the state backends
SELECTED = ("large_activations or unbounded_tokens or cuda_graphs or remote_slots-h or "
            "(one_token and bf16-silu)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gaps")
    srcs = []
    for name, (cls, support, extra) in {**WRONG, "gap_honest": HONEST}.items():
        impl = (HERE / ("honest_bf16.py" if name == "gap_honest" else "liars.py")).read_text()
        code = PLUGIN.format(name=name, module=name, cls=cls, support=support, extra=extra)
        srcs.append(build_plugin_dist(root, f"moe-runtime-{name.replace('_', '-')}", name, name,
                                      code, {"impl": impl}))
    pip_install_target(srcs, root / "site")
    return root / "site"


def _outcomes(xml: Path) -> dict:
    """backend -> {"passed"/"failed"/"skipped": [case ids], "texts": [...], "skips": [...]}."""
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = tc.get("name", "")
        case = name[name.index("[") + 1:-1] if "[" in name else name
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        skip = tc.find("skipped")
        kind = "failed" if bad is not None else "skipped" if skip is not None else "passed"
        by[case.split("-")[0]][kind].append(case)
        if bad is not None:
            by[case.split("-")[0]]["texts"].append(bad.text or bad.get("message", ""))
        if skip is not None:
            by[case.split("-")[0]]["skips"].append(skip.get("message", ""))
    return by


@pytest.fixture(scope="module")
def verdicts(site, tmp_path_factory):
    xml = tmp_path_factory.mktemp("junit") / "report.xml"
    r = run_cli("conformance", *WRONG, "gap_honest", "--", "-q", "-rs", f"--junitxml={xml}",
                "-p", "no:randomly", "-k", SELECTED, site=site, timeout=1800)
    assert xml.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, _outcomes(xml)


def test_the_honest_backend_passes_the_new_cases(verdicts):
    _, by = verdicts
    honest = by["gap_honest"]
    assert not honest["failed"], honest["texts"][:2]
    for shape in ("large_activations", f"unbounded_tokens{UNBOUNDED_CASE_TOKENS_PER_FORWARD}",
                  f"unbounded_tokens{UNBOUNDED_PAST_CASE_TOKENS}"):
        assert any(shape in c for c in honest["passed"]), (shape, honest["passed"][:5])


def test_large_bf16_activations_are_sent_and_an_fp16_output_overflows(verdicts):
    _, by = verdicts
    wrong = by["gap_fp16_output"]
    assert wrong["failed"] and all("large_activations" in c for c in wrong["failed"]), wrong
    # bf16-activation formats only: a float16 model's own overflow is legitimate
    assert not any(c.startswith("gap_fp16_output-fp16-") and "large_activations" in c
                   for c in wrong["passed"] + wrong["failed"])
    assert any(c.startswith("gap_fp16_output-fp8_w8a8-") and "-fp8-large_activations" in c
               for c in wrong["failed"]), wrong["failed"]
    assert all("output has NaN or inf in" in t and "where the reference is finite" in t
               and "float16's largest value is 65504" in t for t in wrong["texts"]), wrong["texts"][:1]


def test_an_undeclared_bound_is_run_past_the_default_deployments_batch(verdicts):
    _, by = verdicts
    assert UNBOUNDED_PAST_CASE_TOKENS > UNBOUNDED_CASE_TOKENS_PER_FORWARD
    wrong = by["gap_past_4096"]
    assert wrong["failed"] == [c for c in wrong["failed"]
                               if f"unbounded_tokens{UNBOUNDED_PAST_CASE_TOKENS}" in c]
    assert wrong["failed"], wrong
    assert any(f"unbounded_tokens{UNBOUNDED_CASE_TOKENS_PER_FORWARD}-" in c
               for c in wrong["passed"]), wrong["passed"]


def test_an_unchecked_cuda_graphs_promise_is_skipped_with_the_reason(verdicts):
    r, by = verdicts
    skipped = [c for c in by["gap_graphs"]["skipped"] if "-cuda_graphs-" in c]
    assert skipped, by["gap_graphs"]
    reason = "needs a CUDA device: the cuda_graphs=True declaration is not checked here"
    assert any(reason in m for m in by["gap_graphs"]["skips"]), by["gap_graphs"]["skips"]
    assert reason in r.stdout  # -rs: the summary says so
    # a backend that promises nothing has no such case
    assert not any("-cuda_graphs-" in c for kind in ("passed", "failed", "skipped")
                   for c in by["gap_remote_zero"][kind])


@pytest.mark.parametrize("name", ["gap_remote_zero", "gap_random"])
def test_a_wrong_backend_without_state_is_not_said_to_have_any(verdicts, name):
    _, by = verdicts
    texts = by[name]["texts"]
    assert texts, by[name]
    assert not any("state shared between instances" in t or "state kept" in t for t in texts), (
        texts[:1])
    assert all("max error" in t for t in texts), texts[:1]


def test_instances_that_disagree_without_evidence_of_state_are_said_to_disagree(verdicts):
    _, by = verdicts
    texts = by["gap_masked_first"]["texts"]
    assert texts and not any("state shared between instances" in t for t in texts), texts[:1]
    # whichever instance the seed makes wrong, the words say what was seen, no more
    assert any(("the two instances disagree" in t and "possible causes" in t)
               or "the error depends on which expert holds which rows" in t
               for t in texts), texts[:1]


def test_shared_and_kept_state_is_still_named(verdicts):
    _, by = verdicts
    for name, words in (("gap_cached_by_shape", "the second's output is what this one computes "
                                                "on the second's inputs"),
                        ("gap_class_weights", "meets it again once a third instance is prepared "
                                              "with this one's weights"),
                        ("gap_first_routing", "state kept between forwards: this instance's "
                                              "second forward")):
        texts = by[name]["texts"]
        assert texts and any(words in t for t in texts), (name, texts[:1])


def test_a_mistyped_case_id_fails_naming_it_and_known_ids(site):
    r = run_cli("conformance", "gap_remote_zero", "--case", "gap_remote_zero-no_such_case",
                site=site)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "'gap_remote_zero-no_such_case'" in r.stderr, r.stderr
    assert "no case of gap_remote_zero has this id" in r.stderr, r.stderr
    assert "'gap_remote_zero-bf16-silu-token_major-unquantized-" in r.stderr, r.stderr
    # straight through pytest, as a backend's own test module runs the suite, too
    r = run_cli("conformance", "gap_remote_zero", "--", "--moe-conformance-case", "nope",
                site=site)
    assert r.returncode != 0 and "'nope'" in r.stdout + r.stderr, r.stdout[-2000:]
