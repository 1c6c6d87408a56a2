"""Each rule of the house is written once: a second copy of one is found by a pattern and fails here.

The rules: which experts live on which rank (``moe_runtime/placement.py``), model dtype names and
config.json's dtype keys (``moe_runtime/dtypes.py``), safetensors headers and index weight maps
(``moe_runtime/checkpoint/tensors.py``), and whether a declaration accepts a layer
(``Support.check`` in ``moe_runtime/declarations.py``). Code that needs one calls its home.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Rule:
    name: str
    home: str  # the one file allowed to write it
    call: str  # what other code calls instead
    patterns: tuple[str, ...] = attrs.field(converter=tuple)
    #: path -> why a match there is not a second copy of the rule
    allowed: dict = attrs.field(factory=dict)


RULES = (
    Rule(
        "expert placement", "moe_runtime/placement.py",
        "moe_runtime.placement.local_experts / owner_table (or ExpertsSetup.local_experts)",
        [r"\b(?:self\.)?(?:ep_)?rank\s*\*\s*[A-Za-z_]",  # rank * experts_per_rank
         r"//\s*(?:self\.)?(?:world|world_size|ep_size|num_ranks|ranks|w)\b",
         r"divmod\(\s*[\w.]*num_experts"],
        {"plugins/deepep/tests/deepep_sim.py":
            "simulates DeepEP itself, whose placement (num_experts / ranks, divisible) the "
            "plugin's tests check against moe-runtime's"},
    ),
    Rule(
        "model dtype names", "moe_runtime/dtypes.py",
        "moe_runtime.dtypes.model_dtype_name / torch_dtype / config_dtype",
        [r"[\"'](?:bfloat16|float16|float32|half)[\"']\s*:\s*(?:torch\.|[\"'])",  # name tables
         r"getattr\(\s*torch\s*,\s*[\w.]*dtype\b",  # a torch dtype from a dtype name
         r"\.get\(\s*[\"']torch_dtype[\"']"],  # config.json's dtype keys
    ),
    Rule(
        "safetensors index and header parsing", "moe_runtime/checkpoint/tensors.py",
        "moe_runtime.checkpoint.tensors.weight_map_of / read_header / read_tensor_index",
        [r"[\"']weight_map[\"']", r"struct\.unpack\(\s*[\"']<Q"],
    ),
    Rule(
        "declaration matching", "moe_runtime/declarations.py",
        "Support.check / ExpertsBackendSpec.check / require_setup / accepting",
        # a layer's format/activation/layout looked up in a declaration's sets (the registry's
        # tables of registered names are another thing)
        [r"\.format\s+(?:not\s+)?in\s+(?!(?:self\.)?registry\.)[\w.]+\.formats\b",
         r"\.activation\s+(?:not\s+)?in\s+[\w.]+\.activations\b",
         r"\.layout\s+(?:not\s+)?in\s+[\w.]+\.layouts\b"],
    ),
)


def _sources() -> list[Path]:
    """The core and the plugins, their tests included (tests are where copies creep in)."""
    files = list((ROOT / "moe_runtime").rglob("*.py"))
    for plugin in sorted((ROOT / "plugins").iterdir()):
        files += [p for p in plugin.rglob("*.py")
                  if not any(part.endswith(".egg-info") or part in ("build", "__pycache__")
                             for part in p.relative_to(plugin).parts)]
    return sorted(files)


def _copies(rule: Rule) -> list[str]:
    out = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == rule.home or rel in rule.allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in rule.patterns):
                out.append(f"{rel}:{n}: {line.strip()}")
    return out


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_is_written_once(rule):
    copies = _copies(rule)
    assert not copies, (
        f"the {rule.name} rule lives in {rule.home}; these lines look like a second copy of it:\n  "
        + "\n  ".join(copies) + f"\ncall {rule.call} instead (or, if a line is not a copy, say why "
        "in this rule's allowed= entry)")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_patterns_find_the_rule_in_its_home(rule):
    """A pattern that no longer matches the home itself would pass on any copy: keep them live."""
    home = (ROOT / rule.home).read_text()
    live = [p for p in rule.patterns if re.search(p, home)]
    assert live, f"no pattern of the {rule.name} rule matches {rule.home}"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_allowed_exceptions_still_exist(rule):
    for rel in rule.allowed:
        path = ROOT / rel
        assert path.exists(), f"{rel} is gone: drop its allowed= entry from the {rule.name} rule"
        text = path.read_text()
        assert any(re.search(p, text) for p in rule.patterns), (
            f"{rel} no longer holds a {rule.name} pattern: drop its allowed= entry")
