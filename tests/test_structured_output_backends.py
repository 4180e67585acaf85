"""The in-tree structured-output backends through the conformance kit (pagedllm.testing), the kit's own
teeth (a backend that over-allows fails it), and backend selection with its reasons."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

from pagedllm.plugin_manager import get_plugin_manager  # noqa: E402
from pagedllm.plugin_spec import PluginKind  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.selection import select_backend  # noqa: E402
from pagedllm.testing import check_structured_output_backend  # noqa: E402
from pagedllm.testing.components import temporary_component  # noqa: E402


def test_xgrammar_passes_the_kit_with_exact_masks() -> None:
    report = check_structured_output_backend("xgrammar")
    assert report.walks == 16 and report.masks_checked_exactly > 40


def test_llguidance_passes_the_kit() -> None:
    # llguidance narrows a forced continuation to its canonical tokens, so only "allowed => alive" is checked.
    report = check_structured_output_backend("llguidance", complete_masks=False)
    assert report.walks == 16 and report.masks_checked_exactly > 40


def _over_allowing() -> Any:
    from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarBackend, XgrammarGrammar

    class LooseGrammar(XgrammarGrammar):
        def fill_bitmask(self, bitmask: Any, index: int) -> None:
            super().fill_bitmask(bitmask, index)
            bitmask[index, 0] = -1  # also allows tokens 0..31, whatever the grammar says

    class LooseBackend(XgrammarBackend):
        def make_grammar(self, compiled: Any) -> LooseGrammar:
            return LooseGrammar(super().make_grammar(compiled).matcher)

    return LooseBackend


def test_the_kit_fails_a_backend_whose_mask_allows_too_much() -> None:
    with (temporary_component(PluginKind.STRUCTURED_OUTPUT, "loose", _over_allowing),
          pytest.raises(AssertionError, match="allowed by the mask but the reference says it cannot")):
        check_structured_output_backend("loose", walks=1)


def test_selection_explains_itself() -> None:
    pm = get_plugin_manager()
    lark = StructuredOutputsParams(grammar='start: "a" | "b"')
    sel = select_backend(pm, lark)
    assert sel.winner.name == "llguidance"
    assert "xgrammar reads EBNF grammars only" in sel.explain()
    bounded = StructuredOutputsParams(json={"type": "string", "maxLength": 3})
    sel = select_backend(pm, bounded)
    assert sel.winner.name == "llguidance" and "admit raw control characters" in sel.explain()
    plain = StructuredOutputsParams(json={"type": "integer"})
    assert select_backend(pm, plain).winner.name == "xgrammar"  # the default, by priority
    assert select_backend(pm, plain, default="llguidance").winner.name == "llguidance"  # the config's choice
    tag = StructuredOutputsParams(structural_tag='{"structures": [], "triggers": []}')
    assert select_backend(pm, tag).winner.name == "xgrammar"


def test_structural_tags_validate_with_xgrammar() -> None:
    """Both of vLLM's forms are accepted; a malformed tag is refused naming the field (the output of a
    structural tag is free text between triggers, so a random model never ends one: validation only here)."""
    from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarBackend

    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    XgrammarBackend.validate(StructuredOutputsParams(structural_tag=json.dumps(legacy)))
    with pytest.raises(ValueError, match="^structured_outputs.structural_tag: "):
        XgrammarBackend.validate(StructuredOutputsParams(structural_tag='{"structures": [{"begin": 1}]}'))
    with pytest.raises(ValueError, match="^structured_outputs.structural_tag: "):
        XgrammarBackend.validate(StructuredOutputsParams(structural_tag="not json"))


def test_the_frontend_check_remembers_a_constraint_that_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """structured_outputs_check validates a constraint once (selection.py NOTE): the same schema again costs
    no backend check; another schema, another backend asked for, or a constraint that failed is checked anew,
    and a failure is raised every time."""
    from pagedllm.config import EngineConfig
    from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarBackend
    from pagedllm.structured_output.selection import structured_outputs_check

    calls: list[str] = []
    validate = XgrammarBackend.validate
    monkeypatch.setattr(XgrammarBackend, "validate",
                        staticmethod(lambda p: (calls.append(p.kind), validate(p))[1]))
    check = structured_outputs_check(get_plugin_manager(), EngineConfig())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for _ in range(3):
        check(StructuredOutputsParams(json=dict(schema)))
    assert calls == ["json"]
    check(StructuredOutputsParams(json={**schema, "required": []}))
    check(StructuredOutputsParams(json=dict(schema), disable_any_whitespace=True))
    assert len(calls) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="^structured_outputs.regex"):
            check(StructuredOutputsParams(regex="a\x00b"))
    assert len(calls) == 5


def test_requests_of_one_constraint_share_a_keyed_copy() -> None:
    """The check returns one keyed copy per constraint (constraints.keyed_constraint): a dict schema as its
    JSON text in its own order, its key kept on the copy; the caller's params are never the ones keyed, so a
    schema changed in place after a request is a new constraint, and two property orders are two grammars."""
    from pagedllm.config import EngineConfig
    from pagedllm.structured_output.constraints import constraint_key
    from pagedllm.structured_output.selection import structured_outputs_check

    check = structured_outputs_check(get_plugin_manager(), EngineConfig())
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    mine = StructuredOutputsParams(json=schema)
    first, second = check(mine), check(StructuredOutputsParams(json=dict(schema)))
    assert first is second and first is not mine and mine.json is schema
    assert first.json == json.dumps(schema) and "_constraint_key" not in mine.__dict__
    assert constraint_key(first) == constraint_key(mine) == first.__dict__["_constraint_key"]
    schema["properties"]["c"] = {"type": "boolean"}  # the caller changes its dict in place
    third = check(mine)
    assert third is not first and '"c"' in third.json and constraint_key(third) != constraint_key(first)
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert constraint_key(StructuredOutputsParams(json=reordered)) != constraint_key(first)
