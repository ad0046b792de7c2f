"""Late-interaction (ColBERT / ColPali) scoring: MaxSim, in bounded memory, and the
similarities a loss can be built on.

A late-interaction model gives every row a matrix of token vectors ``[L, D]`` instead of one
vector. The contract (what the model hands the loss): ``outputs["last_hidden_state"]`` is
``[N, L, D]``, each kept token's vector L2-normalised and every other position (padding,
masked tokens) exactly zero, so a token is *present* iff its vector is nonzero. The score
of a query ``q`` and a document ``d`` is

    ``s(q, d) = sum over q's present tokens i of max over d's present tokens j of q_i . d_j``

(absent document tokens never win the max; a document with no present token scores 0 for
every query token). ``normalize=True`` divides by the number of ``q``'s present tokens
(colpali-engine's ``normalize_scores``, sentence-transformers' ``meanmaxsim``).

The full product of ``b`` queries and ``c`` documents is ``[b, c, Lq, Ld]``, far larger
than either input (64 queries x 32 tokens against 256 documents x 256 tokens is 134 M
numbers); :func:`maxsim` builds it a chunk at a time and keeps for backward only the
argmax indices ``[b, Lq, c]`` (``torch.max`` over a dim saves its indices, not its input).

A loss takes its similarity as a :class:`Similarity`: :data:`DOT` (``[N, D]`` embeddings,
the dot product) or :class:`MaxSim` (``[N, L, D]``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

#: the default ``chunk`` of :func:`maxsim`: elements of the transient product per step
#: (2**25: 128 MiB in float32)
DEFAULT_CHUNK = 2**25


def present_tokens(x: Tensor) -> Tensor:
    """``[..., L]`` bool: which token vectors of ``x [..., L, D]`` are present (nonzero)."""
    return x.ne(0).any(-1)


def trim_tokens(x: Tensor) -> Tensor:
    """``x [N, L, D]`` without its trailing token columns that are absent in every row (a view).

    Queries are usually far shorter than the batch's padded length; trimming them first
    shrinks every product MaxSim makes. At least one column is kept.
    """
    if x.dim() != 3:
        raise ValueError(f"trim_tokens expects [N, L, D], got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        return x
    used = present_tokens(x).any(0)  # [L]
    nonzero = used.nonzero()
    keep = int(nonzero[-1]) + 1 if nonzero.numel() else 1
    return x if keep == x.shape[1] else x[:, :keep]


def _check(name: str, x: Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"MaxSim expects {name} [n, L, D] token vectors, got shape {tuple(x.shape)}")


def _query_lengths(queries: Tensor) -> Tensor:
    """``[b]``: each query's number of present tokens, at least 1 (a query with none scores 0)."""
    return present_tokens(queries).sum(-1).clamp_min(1).to(queries.dtype)


def _max_over_docs(sim: Tensor, doc_present: Tensor) -> Tensor:
    """``sim [..., Ld]`` (the product, overwritten in place) -> ``[...]``: the max over the
    present document tokens, 0 where the document has none."""
    sim.masked_fill_(~doc_present, float("-inf"))
    best = sim.max(-1).values  # saves its indices for backward, not ``sim``
    return torch.where(doc_present.any(-1), best, best.new_zeros(()))


def _present_sum(best: Tensor, q_present: Tensor, dim: int) -> Tensor:
    """The sum over the present query tokens. An absent query token (a zero vector) would add
    0 anyway, but its max would pass a gradient to one arbitrary document token (every
    present one ties at 0); masked, absent tokens neither score nor get gradient."""
    return torch.where(q_present, best, best.new_zeros(())).sum(dim)


def maxsim(queries: Tensor, docs: Tensor, *, normalize: bool = False, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """MaxSim of every query against every document.

    Args:
        queries: ``[b, Lq, D]`` token vectors, absent tokens exactly zero.
        docs: ``[c, Ld, D]`` likewise.
        normalize: Divide each score by the query's number of present tokens.
        chunk: Most elements of the query-document product held at once (>= 1). A step
            takes ``k = max(1, chunk // (b' * Lq * Ld))`` documents against ``b'`` queries,
            ``b' = min(b, max(1, chunk // (Lq * Ld)))``.

    Returns:
        ``[b, c]``: ``out[i, j] = s(queries[i], docs[j])``, in the inputs' dtype.

    Memory:
        With ``s`` the element size in bytes and ``P = max(chunk, Lq * Ld)`` (one query
        against one document is the smallest step), the forward's transient is at most
        ``P * s`` bytes for the product (masked in place) plus ``(P / Ld) * (s + 8)`` for
        the step's maxima and their int64 indices; the backward's transient is one step's
        gradient of the product, again at most ``P * s``. What stays saved for backward
        over the whole call is the indices, ``b * c * Lq * 8`` bytes (``Ld`` times less
        than the product), and views of the inputs; never the product itself
        (``tests/losses/test_maxsim.py`` checks the saved tensors).
    """
    _check("queries", queries)
    _check("docs", docs)
    if queries.shape[-1] != docs.shape[-1]:
        raise ValueError(f"queries and docs must have the same width, got {queries.shape[-1]} and {docs.shape[-1]}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"MaxSim chunk must be an integer >= 1, got {chunk!r}")
    b, lq, dim = queries.shape
    c, ld, _ = docs.shape
    if b == 0 or c == 0 or lq == 0 or ld == 0:
        return queries.new_zeros((b, c))
    doc_present = present_tokens(docs)  # [c, Ld]
    q_present = present_tokens(queries)  # [b, Lq]
    q_rows = min(b, max(1, chunk // (lq * ld)))
    d_rows = max(1, chunk // (q_rows * lq * ld))
    # split, not sliced: one backward concatenates the steps' gradients (a slice's backward
    # would write each step's into a zero tensor of the whole input's size)
    doc_steps = docs.reshape(c * ld, dim).split(d_rows * ld)
    rows = []
    for qs, q in zip(range(0, b, q_rows), queries.split(q_rows)):
        nq = q.shape[0]
        flat_q = q.reshape(nq * lq, dim)
        cols = []
        for ds, step_docs in zip(range(0, c, d_rows), doc_steps):
            de = min(c, ds + d_rows)
            sim = (flat_q @ step_docs.T).view(nq, lq, de - ds, ld)
            cols.append(_max_over_docs(sim, doc_present[None, None, ds:de]))  # [nq, Lq, k]
        best = cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)  # [nq, Lq, c]
        rows.append(_present_sum(best, q_present[qs : qs + q_rows, :, None], 1))
    scores = rows[0] if len(rows) == 1 else torch.cat(rows)
    return scores / _query_lengths(queries)[:, None] if normalize else scores


def maxsim_pairs(queries: Tensor, docs: Tensor, *, normalize: bool = False, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """MaxSim of row ``i`` of ``queries [n, Lq, D]`` against row ``i`` of ``docs [n, Ld, D]``.

    Returns ``[n]``. The transient product is at most ``max(chunk, Lq * Ld)`` elements
    (``n' = max(1, chunk // (Lq * Ld))`` rows per step); backward keeps the int64 argmax
    indices ``[n, Lq]``, as :func:`maxsim` does.
    """
    _check("queries", queries)
    _check("docs", docs)
    if queries.shape[0] != docs.shape[0] or queries.shape[-1] != docs.shape[-1]:
        raise ValueError(f"maxsim_pairs needs queries [n, Lq, D] and docs [n, Ld, D], got "
                         f"{tuple(queries.shape)} and {tuple(docs.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"MaxSim chunk must be an integer >= 1, got {chunk!r}")
    n, lq, _ = queries.shape
    ld = docs.shape[1]
    if n == 0 or lq == 0 or ld == 0:
        return queries.new_zeros((n,))
    doc_present = present_tokens(docs)  # [n, Ld]
    q_present = present_tokens(queries)  # [n, Lq]
    step = max(1, chunk // (lq * ld))
    parts = []
    for s, q, d in zip(range(0, n, step), queries.split(step), docs.split(step)):
        sim = torch.bmm(q, d.transpose(1, 2))  # [n', Lq, Ld]
        best = _max_over_docs(sim, doc_present[s : s + step, None, :])  # [n', Lq]
        parts.append(_present_sum(best, q_present[s : s + step], -1))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    return scores / _query_lengths(queries) if normalize else scores


class Similarity:
    """How a loss scores a query against a document: :meth:`matrix` (every query against
    every document) and :meth:`pairs` (row against row), on embeddings with
    :attr:`ndim` dimensions."""

    #: the number of dimensions of one batch of embeddings (2: ``[N, D]``, 3: ``[N, L, D]``)
    ndim: ClassVar[int] = 2
    #: what the embeddings are called in messages
    shape_text: ClassVar[str] = "[N, D]"

    def matrix(self, queries: Tensor, docs: Tensor) -> Tensor:
        """``[b, c]``: every query against every document."""
        raise NotImplementedError

    def pairs(self, queries: Tensor, docs: Tensor) -> Tensor:
        """``[n]``: query ``i`` against document ``i``."""
        raise NotImplementedError

    def trim(self, x: Tensor) -> Tensor:
        """``x`` as it is worth scoring (token vectors: without all-absent trailing columns)."""
        return x

    def default_temperature(self, fallback: float) -> float:
        """The temperature a loss takes when none is given (``fallback``: the loss's own)."""
        return fallback

    def check(self, owner: str, emb: Tensor) -> None:
        """A ValueError naming ``owner`` unless ``emb`` has :attr:`ndim` dimensions."""
        if emb.dim() != self.ndim:
            raise ValueError(f"{owner} with {self!r} expects last_hidden_state {self.shape_text}, "
                             f"got shape {tuple(emb.shape)}")


class DotProduct(Similarity):
    """The dot product of ``[N, D]`` embeddings (L2-normalised: the cosine)."""

    def matrix(self, queries: Tensor, docs: Tensor) -> Tensor:
        return queries @ docs.T

    def pairs(self, queries: Tensor, docs: Tensor) -> Tensor:
        return (queries * docs).sum(-1)

    def __repr__(self) -> str:
        return "DOT"


#: the dot product, every dense loss's similarity
DOT = DotProduct()


class MaxSim(Similarity):
    """MaxSim of ``[N, L, D]`` token vectors (:func:`maxsim`).

    Args:
        normalize: Divide by the query's number of present tokens (colpali-engine's
            ``normalize_scores``).
        chunk: :func:`maxsim`'s bound on the transient product, in elements.

    The default temperature (a loss built without one, e.g. ``INFONCE_TEMPERATURE`` unset):
    1.0 for the raw sum (sentence-transformers' and PyLate's ``scale=1``), 0.02 with
    ``normalize`` (colpali-engine's ``ColbertLoss``).
    """

    ndim: ClassVar[int] = 3
    shape_text: ClassVar[str] = "[N, L, D] (token vectors, absent tokens zero)"

    #: the default temperatures, without and with ``normalize``
    TEMPERATURE: ClassVar[float] = 1.0
    NORMALIZED_TEMPERATURE: ClassVar[float] = 0.02

    def __init__(self, normalize: bool = False, chunk: int = DEFAULT_CHUNK) -> None:
        if not isinstance(normalize, bool):
            raise ValueError(f"MaxSim normalize must be a bool, got {normalize!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"MaxSim chunk must be an integer >= 1, got {chunk!r}")
        self.normalize = normalize
        self.chunk = chunk

    def matrix(self, queries: Tensor, docs: Tensor) -> Tensor:
        return maxsim(queries, docs, normalize=self.normalize, chunk=self.chunk)

    def pairs(self, queries: Tensor, docs: Tensor) -> Tensor:
        return maxsim_pairs(queries, docs, normalize=self.normalize, chunk=self.chunk)

    def trim(self, x: Tensor) -> Tensor:
        return trim_tokens(x)

    def default_temperature(self, fallback: float) -> float:
        return self.NORMALIZED_TEMPERATURE if self.normalize else self.TEMPERATURE

    def __repr__(self) -> str:
        return f"MaxSim(normalize={self.normalize}, chunk={self.chunk})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaxSim) and (self.normalize, self.chunk) == (other.normalize, other.chunk)

    def __hash__(self) -> int:
        return hash((MaxSim, self.normalize, self.chunk))
