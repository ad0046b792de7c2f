"""The instructions' one home (mmembed/encoding/instructions.py): the system prompt of a text by
(dataset, side, row), in the order docs/instructions.md states, each step written out as the string the
MiniLM / BERT template renders ('{system} {text}')."""

import dataclasses

import pytest

from mmembed.data.sample import Item
from mmembed.encoding.instructions import Instructions
from mmembed.encoding.templates import get_template


@pytest.fixture
def template():
    # the flags: --system S, --query_system Q (no --document_system)
    return dataclasses.replace(get_template("bert"), default_system="S", query_system="Q")


def rendered(instructions, template, item, side, dataset):
    return template.render(instructions.with_side(template, item, side, dataset))


@pytest.mark.parametrize("item, side, dataset, want", [
    (Item("t", system="ROW"), "query", 0, "ROW t"),      # the row's own system first
    (Item("t", system="ROW"), "document", 1, "ROW t"),
    (Item("t"), "query", 0, "DQ t"),                     # then its dataset's, for its side
    (Item("t"), "document", 0, "S t"),                   # dataset 0 gives none for documents: --system
    (Item("t"), "query", 1, "Q t"),                      # dataset 1 gives none for queries: --query_system
    (Item("t"), "document", 1, "DD t"),
    (Item("t"), "query", 2, "Q t"),                      # a dataset past the list gives none
    (Item("t"), "document", 2, "S t"),
    (Item("t"), "query", 3, "t"),                        # an empty instruction is one: no system prompt
])
def test_the_order_of_precedence(template, item, side, dataset, want):
    instructions = Instructions((("DQ", None), (None, "DD"), (None, None), ("", None)))
    assert rendered(instructions, template, item, side, dataset) == want
    assert instructions.system(template, item, side, dataset) == want.rpartition(" ")[0]


def test_no_dataset_instructions_leave_the_template(template):
    none = Instructions.of([type("Entry", (), {"query_system": None, "document_system": None})()])
    assert not none and none.templates(template) == {}
    assert none.template_for(template, 0) is template
    some = Instructions(((None, None), ("A", None)))
    assert some and list(some.templates(template)) == [1] and some.templates(template)[1].query_system == "A"
