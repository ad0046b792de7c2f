"""ms-swift's embedding and reranker model types that mmembed does not train, each with why.

Every other model type ms-swift 4.6 registers for embedding or reranking (the list its own code
reads, tests/fixtures/swift/model_list.json) is one of the ``model_types`` of a template in
templates/, which :func:`~mmembed.encoding.templates.get_template` finds for the model type's
task. docs/swift.md's table of those model types is made from the three at build time
(docs/hooks/generated.py, marker ``swift-models``), and tests/tools/test_swift_model_list.py
holds them together: a model type of ms-swift's list that no template names and that is not
below fails, and so does a reason kept here for a model type a template now names.

This module imports nothing, so the docs build reads it without loading torch.
"""

from __future__ import annotations

#: ms-swift model type -> why mmembed does not train it (said in ``unknown --model_type`` errors too)
NOT_SUPPORTED: dict[str, str] = {
    "monkeyocrv2": (
        "MonkeyOCRv2's vision encoder (MonkeyOCRv2VisionTransformer, pictures only) is code shipped in the model "
        "folder (ms-swift loads it with trust_remote_code), and mmembed runs no model folder's own code; "
        "transformers has no such class"),
}


def why_not(model_type: str | None) -> str | None:
    """Why mmembed does not train ms-swift's ``model_type`` (None: no reason is kept for it)."""
    return NOT_SUPPORTED.get(model_type or "")
