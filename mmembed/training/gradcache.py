"""GradCache: a contrastive step on a batch too large to embed with graph at once.

A contrastive loss needs every embedding of the batch at once, but the encoder's graph
for all ``N`` rows may not fit in memory. The loss, however, only sees the embeddings
``[N, D]``, and the encoder embeds each row on its own. So the step is cut in two:

1. **Embed without graph.** Split the rows into chunks of at most ``mini_batch_size``
   and embed each under ``torch.no_grad()``, noting the RNG state before each chunk.
2. **Loss on the cache.** Concatenate the chunk embeddings into one leaf tensor
   ``reps`` and backpropagate the loss into it: ``reps.grad = d loss / d reps``.
3. **Backward chunk by chunk.** Embed each chunk again, now with graph, and call
   ``reps_chunk.backward(reps.grad[chunk rows])``. By the chain rule the parameter
   gradients add up to those of the plain step; only one chunk's graph is alive at a time.

The invariant that makes this exact: each chunk's second forward must return the very
embeddings of its first. Two things guarantee it.

- **Randomness is replayed** (:class:`RandContext`, the only place that handles it): the
  CPU and CUDA RNG states captured before a chunk's first forward are restored for its
  second, so dropout draws the same masks.
- **The model is deterministic per row**: a row's embedding depends on that row alone
  (true of transformer encoders with an attention mask; not of batch-norm across rows),
  and the model, its mode (``train()``/``eval()``) and any autocast are the same in both
  passes.

With that, loss and gradients equal those of embedding the same chunks with graph,
concatenating, and calling ``loss.backward()``, up to float rounding; without dropout
that is the plain whole-batch step itself, since rows do not interact.

Example:
    ::

        from mmembed.training.gradcache import GradCache

        cache = GradCache(model, loss_fn, mini_batch_size=32)
        loss = cache.step(batch, batch["labels"])  # parameter .grad now filled
        optimizer.step()

For a cross-device loss, call the halves yourself and gather in between::

        chunks = cache.split(batch)
        reps, states = cache.embed_without_graph(chunks)
        loss = global_loss(gather_with_grad(reps), labels)
        loss.backward()
        cache.backward_chunks(chunks, states, reps.grad, backward_fn=..., no_sync=...)

Under DeepSpeed, :func:`deepspeed_chunk_backward` is the ``backward_fn`` that keeps the
engine from stepping the optimizer after every chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

REPS_KEY = "last_hidden_state"

Batch = dict[str, Any]
SplitFn = Callable[[Mapping[str, Any], int], list[Batch]]
LossFn = Callable[[Mapping[str, Tensor], Tensor], Tensor]
BackwardFn = Callable[[Tensor, Tensor, bool], None]
NoSync = Callable[[], AbstractContextManager[Any]]


class RandContext:
    """The RNG state at creation, replayed inside ``with``.

    Create one right before a chunk's first forward and enter it around the second: every
    random draw (dropout masks) then repeats. On exit the RNG goes back to where it stood
    before ``with``, so the replay consumes no randomness of its own and the run's RNG
    stream is the one of the first pass.

    Args:
        devices: CUDA devices whose generators to capture as well as the CPU's (each
            device has its own); empty on a CPU-only run.
    """

    def __init__(self, devices: Iterable[torch.device | int] = ()) -> None:
        self.devices = sorted({_cuda_index(d) for d in devices})
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.devices]
        self._fork: AbstractContextManager[Any] | None = None

    def __enter__(self) -> RandContext:
        self._fork = torch.random.fork_rng(devices=self.devices)  # puts the RNG back on exit
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        for device, state in zip(self.devices, self.cuda_states, strict=True):
            torch.cuda.set_rng_state(state, device)
        return self

    def __exit__(self, *exc: Any) -> None:
        fork, self._fork = self._fork, None
        assert fork is not None, "RandContext exited without being entered"
        fork.__exit__(*exc)


def split_batch(batch: Mapping[str, Any], mini_batch_size: int) -> list[Batch]:
    """Cut a text batch into chunks of at most ``mini_batch_size`` rows, in order.

    Every tensor with one row per input (``input_ids [N, L]``, ``attention_mask``,
    ``token_type_ids``, ...) is sliced along dim 0; ``labels`` is left out (the loss gets
    it whole); other values (scalars, ``None``) are given to every chunk as they are.

    Args:
        batch: A collated batch; ``N`` is ``batch["input_ids"].shape[0]``.
        mini_batch_size: Rows per chunk, >= 1; the last chunk may be smaller.

    Returns:
        ``ceil(N / mini_batch_size)`` dicts whose row tensors hold consecutive rows.

    Raises:
        ValueError: ``mini_batch_size < 1``, no ``input_ids`` or no rows, or a tensor
            without ``N`` rows (pixel values, image grids: pass a ``split_fn`` that knows
            which pixels belong to which row).
    """
    _check_mini_batch_size(mini_batch_size)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ids = inputs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() < 1 or ids.shape[0] == 0:
        raise ValueError("split_batch needs a non-empty input_ids tensor [N, L]; for other batches pass a split_fn")
    n = ids.shape[0]
    n_chunks = -(-n // mini_batch_size)
    chunks: list[Batch] = [{} for _ in range(n_chunks)]
    for key, value in inputs.items():
        if isinstance(value, Tensor) and value.dim() >= 1:
            if value.shape[0] != n:
                raise ValueError(
                    f"batch[{key!r}] has {value.shape[0]} rows but input_ids has {n}; a tensor that is not "
                    "one row per input (e.g. pixel_values) cannot be split by rows: pass a split_fn"
                )
            parts: Sequence[Any] = value.split(mini_batch_size)
        else:
            parts = [value] * n_chunks
        for chunk, part in zip(chunks, parts, strict=True):
            chunk[key] = part
    return chunks


class GradCache:
    """A contrastive training step whose memory is that of one chunk's graph.

    Args:
        model: Called as ``model(**chunk)``, returns ``{"last_hidden_state": [n, D]}``
            with one embedding per row of the chunk (:class:`mmembed.model.embedding.EmbeddingModel`,
            or any encoder that keeps to this and to the module's invariant).
        loss_fn: Called as ``loss_fn({"last_hidden_state": reps [N, D]}, labels)``, returns
            a scalar (every loss of :mod:`mmembed.losses`). Token vectors ``[n, L, D]``
            (late interaction) are cached too: chunks of different ``L`` are padded with
            zero (absent) tokens to the widest.
        mini_batch_size: Most rows embedded at once, >= 1.
        split_fn: ``split_fn(batch, mini_batch_size) -> list of chunk dicts`` whose
            embeddings, concatenated, are the batch's rows in order; :func:`split_batch`
            when None. Needed for batches whose tensors are not one row per input.
    """

    def __init__(self, model: Callable[..., Mapping[str, Tensor]], loss_fn: LossFn, mini_batch_size: int,
                 split_fn: SplitFn | None = None) -> None:
        _check_mini_batch_size(mini_batch_size)
        self.model = model
        self.loss_fn = loss_fn
        self.mini_batch_size = mini_batch_size
        self.split_fn = split_fn or split_batch

    def split(self, batch: Mapping[str, Any]) -> list[Batch]:
        """The batch's chunks, from ``split_fn`` (``labels`` is not needed by the model)."""
        chunks = self.split_fn(batch, self.mini_batch_size)
        if not chunks:
            raise ValueError("split_fn returned no chunk")
        return chunks

    def embed_without_graph(self, chunks: Sequence[Mapping[str, Any]]) -> tuple[Tensor, list[RandContext]]:
        """First pass: embed every chunk under ``no_grad``, capturing its RNG state first.

        Returns:
            ``(reps, rand_states)``: ``reps [N, D]`` a leaf with ``requires_grad`` (the
            chunks' embeddings, concatenated in order) and one :class:`RandContext` per
            chunk, to hand to :meth:`backward_chunks`.
        """
        devices = _cuda_devices(self.model, chunks)
        reps, rand_states = [], []
        for chunk in chunks:
            rand_states.append(RandContext(devices))
            with torch.no_grad():
                reps.append(self._embed(chunk))
        return _cat_rows(reps).requires_grad_(), rand_states

    def backward_chunks(self, chunks: Sequence[Mapping[str, Any]], rand_states: Sequence[RandContext],
                        grad: Tensor | None, backward_fn: BackwardFn | None = None,
                        no_sync: NoSync | None = None) -> None:
        """Second pass: re-embed each chunk with graph and backpropagate its slice of ``grad``.

        For chunk ``i`` of ``K``, in order, with ``is_last = i == K - 1``:

        1. unless ``is_last``, enter ``no_sync()`` (if given) -- around the forward *and*
           the backward, since DDP decides at forward time whether the next backward
           all-reduces;
        2. ``reps_i = model(**chunks[i])["last_hidden_state"]`` inside ``rand_states[i]``;
        3. ``backward_fn(reps_i, grad_i, is_last)``, or ``reps_i.backward(grad_i)`` when
           None, where ``grad_i`` is the rows of ``grad`` that follow the previous chunks.

        So ``backward_fn`` is called exactly ``K`` times, once per chunk in batch order,
        with ``is_last`` False for all but the last call: that last one is where gradients
        may be synchronised across devices. A backend that only backpropagates scalars can
        use ``(reps_i * grad_i).sum()``, whose gradient with respect to ``reps_i`` is ``grad_i``.

        Args:
            chunks: As given to :meth:`embed_without_graph`.
            rand_states: Its second return value.
            grad: ``d loss / d reps``, ``[N, D]``; None (a loss that ignored the
                embeddings) backpropagates zeros, so every process still joins the sync.
            backward_fn: ``(tensor, grad, is_last) -> None``.
            no_sync: Returns a context manager that suspends gradient sync
                (``lambda: ddp_model.no_sync()``).
        """
        if len(rand_states) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(rand_states)} RNG states")
        start = 0
        for i, (chunk, rand_state) in enumerate(zip(chunks, rand_states, strict=True)):
            is_last = i == len(chunks) - 1
            with no_sync() if no_sync is not None and not is_last else nullcontext():
                with rand_state:
                    reps = self._embed(chunk)
                chunk_grad = torch.zeros_like(reps) if grad is None else grad[start : start + reps.shape[0]]
                if chunk_grad.dim() == 3 and reps.dim() == 3 and chunk_grad.shape[1] > reps.shape[1]:
                    chunk_grad = chunk_grad[:, : reps.shape[1]]  # token vectors: the cache's padding has no graph
                if chunk_grad.shape != reps.shape:
                    raise ValueError(
                        f"chunk {i} re-embedded to {tuple(reps.shape)} but its gradient is {tuple(chunk_grad.shape)}; "
                        "the gradient must be [N, D] for the chunks' rows"
                    )
                start += reps.shape[0]
                if backward_fn is None:
                    reps.backward(chunk_grad)
                else:
                    backward_fn(reps, chunk_grad, is_last)
        if grad is not None and start != grad.shape[0]:
            raise ValueError(f"the chunks have {start} rows but the gradient has {grad.shape[0]}")

    def step(self, batch: Mapping[str, Any], labels: Tensor, backward_fn: BackwardFn | None = None,
             loss_backward_fn: Callable[[Tensor], None] | None = None, no_sync: NoSync | None = None,
             num_chunks_fn: Callable[[int], int] | None = None) -> Tensor:
        """One cached forward and backward: the parameters' ``.grad`` accumulate as after
        ``loss_fn(model(**batch), labels).backward()``.

        The calls, in order, for ``K`` chunks: ``split_fn`` once; ``K`` forwards without
        graph; ``loss_fn`` once; ``loss_backward_fn`` once; then per chunk, in batch order,
        a forward with graph and one ``backward_fn`` (see :meth:`backward_chunks`).

        Args:
            batch: The model's inputs for ``N`` rows (the default ``split_fn`` leaves a
                ``labels`` key out).
            labels: Given to ``loss_fn`` as they are.
            backward_fn, no_sync: See :meth:`backward_chunks`.
            loss_backward_fn: Backpropagates the loss into the cached embeddings;
                ``loss.backward()`` when None. Only the leaf ``reps`` (and any parameters
                of the loss) are behind it, never the model, so plain autograd is
                enough; use it to scale, e.g. ``lambda loss: (loss * scale).backward()``.
            num_chunks_fn: ``K -> K'``, the number of chunk passes to run, ``K' >= K``:
                for backends where every forward or backward is a collective that all
                processes must join (DeepSpeed ZeRO-3 gathers parameters in each forward,
                ZeRO-2/3 reduce gradients in each backward), pass the maximum of ``K`` over
                processes. The ``K' - K`` extra passes repeat the last chunk: after the
                ``K`` forwards without graph (so the real chunks draw the RNG as without
                them) and before the real chunks with graph (so the last ``backward_fn``
                stays the last), with a zero gradient; their embeddings never reach the
                loss, so they change no gradient.

        Returns:
            The loss, detached.
        """
        chunks = self.split(batch)
        n_passes = len(chunks) if num_chunks_fn is None else num_chunks_fn(len(chunks))  # before any forward
        if n_passes < len(chunks):
            raise ValueError(f"num_chunks_fn asked for {n_passes} passes but the batch has {len(chunks)} chunks")
        idle = [chunks[-1]] * (n_passes - len(chunks))
        reps, rand_states = self.embed_without_graph(chunks)
        idle_reps, idle_states = self.embed_without_graph(idle) if idle else (None, [])
        loss = self.loss_fn({REPS_KEY: reps}, labels)
        if loss_backward_fn is None:
            loss.backward()
        else:
            loss_backward_fn(loss)
        grad = reps.grad
        if idle and grad is not None:
            grad = _cat_rows([torch.zeros_like(idle_reps), grad])
        self.backward_chunks(idle + chunks, idle_states + rand_states, grad, backward_fn, no_sync)
        return loss.detach()

    def _embed(self, chunk: Mapping[str, Any]) -> Tensor:
        return self.model(**chunk)[REPS_KEY]


def _cat_rows(reps: Sequence[Tensor]) -> Tensor:
    """The chunks' embeddings in order; token vectors ``[n, L, D]`` of different ``L`` are
    padded with zero (absent) tokens to the widest (a late-interaction loss ignores them)."""
    if reps[0].dim() == 3 and len({r.shape[1] for r in reps}) > 1:
        width = max(r.shape[1] for r in reps)
        reps = [torch.nn.functional.pad(r, (0, 0, 0, width - r.shape[1])) for r in reps]
    return torch.cat(list(reps))


def _check_mini_batch_size(mini_batch_size: int) -> None:
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be an integer >= 1, got {mini_batch_size!r}")


def _cuda_index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_devices(model: Any, chunks: Sequence[Mapping[str, Any]]) -> list[torch.device]:
    """The CUDA devices a step may draw random numbers on: those of the inputs and weights."""
    found = {v.device for chunk in chunks for v in chunk.values() if isinstance(v, Tensor)}
    if isinstance(model, nn.Module):
        found |= {p.device for p in model.parameters()}
    return [d for d in found if d.type == "cuda"]


def deepspeed_chunk_backward(accelerator: Any) -> BackwardFn:
    """The ``backward_fn`` of :meth:`GradCache.step` under DeepSpeed (``accelerator``: the
    accelerate ``Accelerator`` that prepared the engine): K engine backwards that together
    make one micro-batch.

    ``accelerator.backward`` under DeepSpeed sets the engine's gradient accumulation
    boundary to ``sync_gradients`` and, at a boundary, calls ``engine.step()``; called
    once per chunk it would step the optimizer after every chunk. So every chunk but
    the last runs ``engine.backward`` with the boundary off, exactly like the earlier
    micro-batches of gradient accumulation (ZeRO-2/3 reduce-scatter each backward's
    gradients into the owned partition and add them up, which is what keeps the full
    gradient out of memory; stages 0/1 keep them local until the boundary), and the
    last chunk goes through ``accelerator.backward`` like a plain micro-batch. The
    engine's ``no_sync`` is not used: ZeRO-2/3 refuse it. ``scale_wrt_gas=False``, as
    in the Trainer: the cached gradient already carries 1 / gradient_accumulation_steps,
    and going through ``engine.backward`` keeps the engine from dividing again.
    ``(reps * grad).sum()`` is a scalar whose gradient with respect to ``reps`` is
    ``grad`` (fp16 loss scaling applies to it like to a loss).

    ZeRO-2/3 reduce in every backward and ZeRO-3 gathers parameters in every forward,
    so all processes must run as many chunks, though their rows (groups with more or
    fewer negatives) may need more or fewer: pass the maximum over processes as
    ``num_chunks_fn`` of :meth:`GradCache.step` (a process with fewer chunks runs extra
    passes with a zero gradient)."""
    engine = accelerator.deepspeed_engine_wrapped.engine

    def backward(reps: Tensor, grad: Tensor, is_last: bool) -> None:
        surrogate = (reps * grad).sum()
        if is_last:
            accelerator.backward(surrogate, scale_wrt_gas=False)
        else:
            engine.set_gradient_accumulation_boundary(False)
            engine.backward(surrogate, scale_wrt_gas=False)

    return backward
