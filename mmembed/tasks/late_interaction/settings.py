"""The settings of a late-interaction model: the width of its token vectors, how queries are
expanded, which document tokens MaxSim leaves out, and whether scores are divided by the
query's length. Read from the ``--late_interaction_*`` flags (defaults as the anchors': ColBERT
for a text encoder with a mask token, ColQwen for a chat / vision-language backbone) and written
into each saved model's ``mmembed.json`` under ``late_interaction``.

- ``mask`` expansion (ColBERT, sentence-transformers' ``query_expansion`` with the ``fixed``
  strategy, PyLate's ``do_query_expansion``): a query is cut to ``query_length`` tokens (32) and
  its padding up to that length becomes the tokenizer's mask token, scored by MaxSim and, with
  ``attend_expansion``, attended by the encoder (default not, as PyLate).
- ``augment`` expansion (ColQwen2): ``query_length`` (10) copies of the tokenizer's pad token
  appended to the query's text, attended and scored.
- ``none``: queries as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import UsageError
from ...model.late_interaction import PUNCTUATION_SKIPLIST, query_expansion_config
from ...model.multivector_io import LATE_INTERACTION_KEY, late_interaction_config, read_late_interaction_config

EXPANSIONS = ("mask", "augment", "none")
SKIPLISTS = {"punctuation": PUNCTUATION_SKIPLIST, "none": ()}
DEFAULT_DIM = 128
DEFAULT_QUERY_LENGTH = {"mask": 32, "augment": 10}  # ColBERT's query length, ColQwen2's augmentation count

#: the flags of --task_type late_interaction
FLAGS = ("late_interaction_dim", "late_interaction_query_expansion", "late_interaction_query_length",
         "late_interaction_attend_expansion", "late_interaction_skiplist", "late_interaction_normalize_scores")


def check_flags(args: Any) -> None:
    """The ``--late_interaction_*`` values, before anything loads."""
    dim = args.late_interaction_dim
    if dim is not None and (isinstance(dim, bool) or dim < 1):
        raise UsageError(f"--late_interaction_dim must be an integer >= 1, got {dim}")
    expansion = args.late_interaction_query_expansion
    if expansion is not None and expansion not in EXPANSIONS:
        raise UsageError(f"--late_interaction_query_expansion must be one of {', '.join(EXPANSIONS)}, got {expansion!r}")
    length = args.late_interaction_query_length
    if length is not None and length < 1:
        raise UsageError(f"--late_interaction_query_length must be an integer >= 1, got {length}")
    if length is not None and expansion == "none":
        raise UsageError("--late_interaction_query_length sets the query expansion's length; "
                         "--late_interaction_query_expansion none expands nothing")
    if args.late_interaction_attend_expansion is not None and expansion in ("augment", "none"):
        raise UsageError(f"--late_interaction_attend_expansion is for the mask expansion (ColBERT's); "
                         f"--late_interaction_query_expansion {expansion} "
                         + ("attends to its tokens always" if expansion == "augment" else "expands nothing"))
    skiplist = args.late_interaction_skiplist
    if skiplist is not None and skiplist not in SKIPLISTS:
        raise UsageError(f"--late_interaction_skiplist must be one of {', '.join(SKIPLISTS)}, got {skiplist!r}")


@dataclasses.dataclass(frozen=True)
class LateInteractionSettings:
    """What a late-interaction model is, beyond its backbone.

    Attributes:
        dim: the width of each token's vector.
        expansion: ``mask``, ``augment`` or ``none``.
        query_length: ``mask``: the query's length (cut and padded to it); ``augment``: the
            number of augmentation tokens; ``none``: None.
        attend_expansion: whether the encoder attends to the expansion tokens.
        expansion_token: the token the expansion adds (the mask token, or the pad token).
        skiplist: the words left out of documents' token vectors.
        normalize_scores: MaxSim divided by the query's number of tokens.
    """

    dim: int = DEFAULT_DIM
    expansion: str = "none"
    query_length: int | None = None
    attend_expansion: bool = False
    expansion_token: str | None = None
    skiplist: tuple[str, ...] = ()
    normalize_scores: bool = False

    @classmethod
    def resolve(cls, args: Any, template: Any, tokenizer: Any) -> LateInteractionSettings:
        """The run's settings: the flags, and for those not given the anchors' defaults for
        this backbone (``tokenizer``: the model's tokenizer; ``template``: its template)."""
        tok = getattr(tokenizer, "tokenizer", None) or tokenizer
        expansion = args.late_interaction_query_expansion
        if expansion is None:  # a text encoder with a mask token is a ColBERT; anything else a ColQwen
            expansion = "mask" if tok.mask_token_id is not None and not template.media else "augment"
        token = None
        if expansion == "mask":
            if tok.mask_token_id is None and tok.eos_token_id is None:
                raise UsageError(f"--late_interaction_query_expansion mask: the tokenizer of {args.model} has no mask "
                                 "(or eos) token to expand queries with; use augment or none")
            token = tok.mask_token if tok.mask_token_id is not None else tok.eos_token
        elif expansion == "augment":
            token = tok.pad_token or tok.eos_token
            if token is None:
                raise UsageError(f"--late_interaction_query_expansion augment: the tokenizer of {args.model} has no pad "
                                 "(or eos) token to append; use none")
        length = args.late_interaction_query_length
        if length is None and expansion != "none":
            length = DEFAULT_QUERY_LENGTH[expansion]
        skiplist = args.late_interaction_skiplist or ("punctuation" if expansion == "mask" else "none")
        return cls(dim=args.late_interaction_dim or DEFAULT_DIM, expansion=expansion,
                   query_length=length if expansion != "none" else None,
                   attend_expansion=bool(args.late_interaction_attend_expansion) if expansion == "mask" else
                   expansion == "augment", expansion_token=token, skiplist=tuple(SKIPLISTS[skiplist]),
                   normalize_scores=bool(args.late_interaction_normalize_scores))

    def query_expansion(self) -> dict[str, Any] | None:
        """The mask expansion as sentence-transformers' ``query_expansion`` dict (None otherwise)."""
        if self.expansion != "mask":
            return None
        return query_expansion_config(self.query_length, strategy="fixed", attend=self.attend_expansion)

    def record(self) -> dict[str, Any]:
        """The ``mmembed.json`` entry (``late_interaction``)."""
        config = late_interaction_config(self.dim, skiplist=self.skiplist,
                                         query_length=self.query_length if self.expansion == "mask" else None,
                                         query_expansion=self.query_expansion(),
                                         normalize_scores=self.normalize_scores)
        config.update(expansion=self.expansion, expansion_token=self.expansion_token,
                      augmentation_tokens=self.query_length if self.expansion == "augment" else None,
                      attend_expansion=self.attend_expansion)
        return config

    @classmethod
    def from_record(cls, mmembed_config: dict[str, Any]) -> LateInteractionSettings:
        """The settings a saved model's ``mmembed.json`` records."""
        config = read_late_interaction_config(mmembed_config)
        expansion = config.get("expansion", "mask" if config.get("query_expansion") else "none")
        length = config.get("augmentation_tokens") if expansion == "augment" else (
            config["query_expansion"]["length"] if config.get("query_expansion") else None)
        return cls(dim=config["dim"], expansion=expansion, query_length=length,
                   attend_expansion=bool(config.get("attend_expansion", False)),
                   expansion_token=config.get("expansion_token"), skiplist=tuple(config["skiplist"]),
                   normalize_scores=config["normalize_scores"])


def saved_settings(mmembed_config: dict[str, Any] | None) -> LateInteractionSettings | None:
    """A saved model's settings, or None when its ``mmembed.json`` has none."""
    if not mmembed_config or LATE_INTERACTION_KEY not in mmembed_config:
        return None
    return LateInteractionSettings.from_record(mmembed_config)
