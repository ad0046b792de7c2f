"""``mmembed`` command line: sft (alias train), embed, rerank, export, eval, mine, serve.

Flags follow ms-swift's spelling; ``mmembed COMMAND --help`` lists them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from ..environment import Environment, for_children
from ..environment import read as read_environment
from ..errors import FALSE_WORDS, TRUE_WORDS, ArgumentParser, UsageError, one_line, parse_bool
from ..hub import add_hub_flags

if TYPE_CHECKING:
    from ..encoding.media import MediaSettings

USAGE = """usage: mmembed COMMAND [flags]

commands:
  sft (train)   fine-tune an embedding model or a reranker (ms-swift's `swift sft --task_type embedding|reranker|generative_reranker` flags)
  embed         embed a file of inputs into a .npy array
  rerank        score and rank documents for queries with a reranker (sigmoid scores as TEI gives them, /v1/rerank-shaped JSONL)
  export        merge a LoRA checkpoint (embedder or reranker) into a standalone folder (--adapters CKPT --merge_lora true)
  eval          STS (Spearman/Pearson) on scored pairs and/or retrieval on a BEIR folder (nDCG@10, MRR@10, recall@k)
  mine          add hard negatives to a data file (BM25 or a dense model, false-negative filters)
  serve         OpenAI-compatible POST /v1/embeddings with dynamic batching (FastAPI + uvicorn)
"""


def take_debug(argv: list[str], debug: bool | None = None) -> tuple[list[str], bool]:
    """``--debug [true|false]`` taken out of ``argv``, for every command; with it (or
    ``MMEMBED_DEBUG=1``: ``debug``, read from the environment when None) an error shows its
    traceback instead of one line. A value that is
    not a boolean (transformers' ``--debug underflow_overflow``) is left for the command's
    parser."""
    rest: list[str] = []
    if debug is None:
        debug = read_environment().debug
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name != "--debug":
            rest.append(token)
            i += 1
            continue
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
        if value is not None and value.strip().lower() not in TRUE_WORDS + FALSE_WORDS:
            rest.append(token)  # not ours
            i += 1
            continue
        debug = True if value is None else parse_bool("--debug", value)
        i += 1 if eq or value is None else 2
    return rest, debug


def _setup_logging(environment: Environment) -> None:
    level = logging.INFO if environment.launch.local_process == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[%(levelname)s:%(name)s] %(message)s")
    logging.getLogger("mmembed").setLevel(level)
    for name in ("httpx", "httpx2"):  # one INFO line per request of a hub download; its progress bars say enough
        logging.getLogger(name).setLevel(logging.WARNING)
    # bitsandbytes' line on a missing optional kernels package: dropped by mmembed/__init__.py


def _maybe_relaunch(argv: list[str], environment: Environment) -> int | None:
    """ms-swift's launch habit: NPROC_PER_NODE (with NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT) re-runs the command under torchrun, once per process."""
    launch = environment.launch
    nproc = launch.integer("NPROC_PER_NODE", 1, 1)
    nnodes = launch.integer("NNODES", 1, 1)
    if (nproc <= 1 and nnodes <= 1) or launch.launched:
        return None
    node_rank = launch.integer("NODE_RANK", 0, 0, nnodes - 1)
    port = launch.integer("MASTER_PORT", 29500, 1, 65535)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
           f"--node_rank={node_rank}", f"--master_addr={launch.address}",
           f"--master_port={port}", "-m", "mmembed.tools.cli", *argv]
    # a preemption signal sent to this process (Kubernetes signals the container's first
    # process) goes on to torchrun, which passes it to every worker: they save the step and
    # exit 143 (mmembed.training.preemption). torchrun passes SIGUSR1 on only when named here.
    # --debug true: the processes torchrun starts show their tracebacks too (MMEMBED_DEBUG=1).
    env = for_children(debug=environment.debug,
                       defaults={"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"})
    # torchrun's own report of a stopped run (its log lines and the ChildFailedError block after
    # mmembed's one-line error) goes to a log file; the processes it starts write to the user's
    # stderr (MMEMBED_WORKER_STDERR, reopened by each: torchrun closes inherited descriptors)
    report = None
    if not environment.debug:
        import tempfile

        handle, report = tempfile.mkstemp(prefix="mmembed-torchrun-", suffix=".log")
        env["MMEMBED_WORKER_STDERR"] = f"/proc/{os.getpid()}/fd/{sys.stderr.fileno()}"
    child = subprocess.Popen(cmd, env=env, stderr=handle if report else None)
    if report:
        os.close(handle)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        child.send_signal(signum)

    forwarded = (signal.SIGTERM, signal.SIGUSR1)
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if report and code == 0:
        os.remove(report)
    elif report:
        try:  # a stderr that is a file was appended to by the processes: write after them
            os.lseek(sys.stderr.fileno(), 0, os.SEEK_END)
        except OSError:  # a terminal or a pipe
            pass
        print(f"mmembed: torchrun's report of the stopped processes: {report}", file=sys.stderr)
    # torchrun exits 1 when its workers stopped for the signal; the run's own code says why
    if received and code != 0:
        from ..training.preemption import EXIT_CODE

        return EXIT_CODE
    return code


def cmd_sft(argv: list[str], environment: Environment | None = None) -> int:
    code = _maybe_relaunch(["sft", *argv], read_environment(environment))
    if code is not None:
        return code
    from ..training.arguments import parse_sft_args
    from ..training.preemption import EXIT_CODE, Preempted
    from ..training.sft import run_sft

    args = parse_sft_args(argv)  # every flag checked: a UsageError names the bad one
    try:
        # the settings that need the model's folder, checked before it loads; the run reads the
        # variables once at its start (after the flags: DeepSpeed alone sets its rank variables)
        metrics = run_sft(args)
    except Preempted as e:  # SIGTERM / SIGUSR1: the step saved; one line on how to resume, 128 + SIGTERM
        if args.should_save:
            print(f"mmembed sft: {e}", file=sys.stderr)
        _close_process_group(EXIT_CODE)
        return EXIT_CODE
    if args.should_save:
        print(json.dumps(metrics, indent=2, default=str))
    _close_process_group(0)
    return 0


def _close_process_group(code: int) -> None:
    """Every rank waits for the others, then takes the process group down and leaves with
    ``code`` at once (its output and logs flushed). Left to the interpreter's exit, a rank
    could tear down threads that gloo or DeepSpeed still hold (seen after complete ZeRO-2
    offload runs: 'terminate called without an active exception', SIGABRT, so torchrun
    reports the finished run as failed). After the barrier every process has read the hub
    markers of its node (``mmembed/training/hub_models.py``): their writers remove them. A
    single-process run returns normally."""
    import torch.distributed as dist

    from ..training.hub_models import remove_markers

    if dist.is_available() and dist.is_initialized():
        several = dist.get_world_size() > 1
        dist.barrier()
        remove_markers()
        dist.destroy_process_group()
        if several:  # a process of torchrun's (a one-process group may live in a caller's process)
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)


def check_model_flags(a, *flags: str, environment: Environment | None = None) -> None:
    """The flags every embedding command shares, checked before a model loads: the model
    flags named by ``flags`` (when given), a hub id resolved to its downloaded folder in its
    place (:func:`mmembed.hub.resolve_model`, with the command's :func:`mmembed.hub.add_hub_flags`), then
    checked to hold a model; ``--batch_size``, ``--torch_dtype`` and the media variables
    (``MAX_PIXELS``, ``FPS``, ...) of ``environment`` (None: read now)."""
    from ..encoding.media import MediaBudget
    from ..hub import HubOptions, resolve_model
    from ..model.embedding import check_model_folder, check_torch_dtype

    options = None
    for flag in flags:
        path = getattr(a, flag.lstrip("-"))
        if path is not None:
            if options is None:
                options = HubOptions.from_flags(getattr(a, "use_hf", None), getattr(a, "model_revision", None),
                                                getattr(a, "hub_token", None), environment)
            path = resolve_model(path, flag, options.for_flag(flag))
            setattr(a, flag.lstrip("-"), path)
            check_model_folder(path, flag)
    check_torch_dtype(a.torch_dtype)
    try:
        MediaBudget.from_env(environment)
    except ValueError as e:
        raise UsageError(str(e)) from None
    batch_size = getattr(a, "batch_size", None)
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch_size must be an integer >= 1, got {batch_size}")


def media_settings(offline: bool = False, environment: Environment | None = None) -> MediaSettings:
    """The command's :class:`~mmembed.encoding.media.MediaSettings`, parsed once at its start
    from the environment (``MAX_PIXELS``, ``FPS``, ..., the download variables; None: read
    now) and its ``--offline`` flag; a malformed variable is a usage error naming it."""
    from ..encoding.media import MediaSettings

    try:
        return MediaSettings.from_env(environment, offline=offline)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_input_files(*flags_and_paths: tuple[str, str | None]) -> None:
    """The data files a command reads, there before its model loads (the user's data: exit status 1)."""
    from ..data import SpecError

    for flag, path in flags_and_paths:
        if path is not None and not os.path.isfile(path):
            raise SpecError(f"{flag} {path}: no such file")


def cmd_embed(argv: list[str], environment: Environment | None = None) -> int:
    p = ArgumentParser(prog="mmembed embed", allow_abbrev=False)
    p.add_argument("--model", required=True, help="checkpoint, exported folder or base model folder, or hub id (ORG/NAME)")
    p.add_argument("--input", required=True, help=".txt (one text per line) or .jsonl/.json/.csv rows with query/text (+ images/videos/audios) or messages")
    p.add_argument("--output", required=True, help="where to write the [n, D] float32 .npy (a late-interaction model: "
                                                   "the token matrices as .npz: vectors [tokens, D], offsets [n + 1])")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--torch_dtype", default=None)
    p.add_argument("--teacher_arrays", action="store_true",
                   help="--input is a training file: write the model's view of every row as a teacher, OUTPUT_embeddings.npy "
                        "[rows, 2 + negatives, D] and OUTPUT_scores.npy [rows, 1 + negatives] (NaN-padded), for "
                        "--teacher_embeddings_file / --teacher_scores_file")
    p.add_argument("--offline", type=_bool, nargs="?", const=True, default=False,
                   help="fetch no http(s) media (as MMEMBED_OFFLINE=1): a URL not in the media cache is an error")
    add_hub_flags(p)
    p.add_argument("--input_type", choices=["query", "document"], default=None,
                   help="embed the inputs as queries or documents, with the instruction the model was trained with "
                        "for that side (--query_system / --document_system; what sentence-transformers' encode_query / "
                        "encode_document give); default: as they are")
    p.add_argument("--pool_factor", type=float, default=None,
                   help="a late-interaction model's documents: merge each one's token vectors by hierarchical "
                        "clustering to about 1 / pool_factor of them (2: half)")
    a = p.parse_args(argv)
    check_model_flags(a, "--model", environment=environment)
    media = media_settings(offline=a.offline, environment=environment)
    check_input_files(("--input", a.input))
    if a.teacher_arrays and a.input_type:
        raise UsageError("--input_type does not go with --teacher_arrays, which embeds a training file's rows as they are")
    import numpy as np

    from ..files import replaced_when_done
    from ..model.embedder import Embedder, read_inputs

    if a.teacher_arrays:
        from .teacher_arrays import teacher_arrays

        stem = a.output[:-4] if a.output.endswith(".npy") else a.output
        emb, scores = teacher_arrays(Embedder.from_pretrained(a.model, torch_dtype=a.torch_dtype, media=media), a.input,
                                     a.batch_size)
        for name, arr in (("embeddings", emb), ("scores", scores)):
            path = f"{stem}_{name}.npy"
            with replaced_when_done(path, "wb") as f:
                np.save(f, arr)
            print(f"wrote {name} {tuple(arr.shape)} to {path}")
        return 0

    inputs, origins = read_inputs(a.input)
    from ..task import task_of_folder

    task = task_of_folder(a.model) if os.path.isdir(a.model) else None
    if a.pool_factor is not None and (task is None or not task.token_vectors or a.pool_factor < 1):
        raise UsageError(f"--pool_factor {a.pool_factor}: pools the token vectors of a late-interaction model's documents "
                         "(a number >= 1)" + ("" if task is not None and task.token_vectors else f"; {a.model} gives "
                                              "one vector per input"))
    if task is not None and task.token_vectors:
        scorer = task.load_scorer(a.model, torch_dtype=a.torch_dtype)
        matrices = scorer.encode(inputs, a.input_type or "document", a.batch_size, pool_factor=a.pool_factor,
                                 origins=origins)
        output = a.output if a.output.endswith(".npz") else a.output + ".npz"
        offsets = np.cumsum([0] + [len(m) for m in matrices])
        with replaced_when_done(output, "wb") as f:
            np.savez(f, vectors=np.concatenate(matrices) if matrices else np.zeros((0, scorer.settings.dim), np.float32),
                     offsets=offsets)
        print(f"wrote the token vectors of {len(matrices)} inputs ({int(offsets[-1])} vectors of "
              f"{scorer.settings.dim}) to {output}")
        return 0
    emb = Embedder.from_pretrained(a.model, torch_dtype=a.torch_dtype, media=media).encode(
        inputs, batch_size=a.batch_size, origins=origins, input_type=a.input_type)
    output = a.output if a.output.endswith(".npy") else a.output + ".npy"  # the name np.save(path) gives
    with replaced_when_done(output, "wb") as f:
        np.save(f, emb)
    print(f"wrote {emb.shape[0]} x {emb.shape[1] if emb.ndim == 2 else 0} embeddings to {output}")
    return 0


def cmd_rerank(argv: list[str], environment: Environment | None = None) -> int:
    p = ArgumentParser(prog="mmembed rerank", allow_abbrev=False,
                       description="Score (query, document) pairs with a reranker and rank each query's documents. "
                                   "Scores are probabilities, sigmoid(s) of the raw score s (the classifier's logit, "
                                   "or logit(yes) - logit(no)), as CrossEncoder.predict and TEI give them; "
                                   "--raw_scores true: s itself.")
    p.add_argument("--model", required=True, help="reranker checkpoint (full or LoRA), exported folder or reranker model folder, or hub id")
    p.add_argument("--query", default=None, help="one query (with --documents)")
    p.add_argument("--documents", default=None,
                   help="the query's documents: .txt (one per line) or .jsonl rows, each a string or {\"text\", \"images\": [...]}")
    p.add_argument("--input", default=None,
                   help="JSONL rows {\"query\": ..., \"documents\": [...]} (each a string or {\"text\", \"images\", ...})")
    p.add_argument("--output", default=None, help="write the results (JSONL, one line per query) here; default: stdout")
    p.add_argument("--top_n", type=int, default=None, help="keep the N best documents of each query (default: all)")
    p.add_argument("--return_documents", type=_bool, nargs="?", const=True, default=False,
                   help="put each result's document in it ({\"text\": ...})")
    p.add_argument("--raw_scores", type=_bool, nargs="?", const=True, default=False,
                   help="give the raw score s (the classifier's logit, or logit(yes) - logit(no)) instead of sigmoid(s)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda when available)")
    p.add_argument("--torch_dtype", default=None)
    p.add_argument("--task_type", default=None,
                   help="for a folder without mmembed.json whose config.json does not say (default: from the folder)")
    add_hub_flags(p)
    a = p.parse_args(argv)
    if a.input is not None and (a.query is not None or a.documents is not None):
        raise UsageError("pass either --input FILE or --query TEXT --documents FILE, not both")
    if a.input is None and (a.query is None or a.documents is None):
        raise UsageError("pass --query TEXT with --documents FILE, or --input FILE (rows with query and documents)"
                         + ("; --documents is missing" if a.query is not None else
                            "; --query is missing" if a.documents is not None else ""))
    if a.top_n is not None and a.top_n < 1:
        raise UsageError(f"--top_n must be an integer >= 1, got {a.top_n}")
    check_model_flags(a, "--model", environment=environment)
    check_input_files(("--input", a.input), ("--documents", a.documents))
    from ..files import replaced_when_done
    from ..task import pair_scorer_task
    from .rerank import RerankQuery, dumps, rank_queries, read_documents, read_rerank_input

    if a.input is not None:
        queries = read_rerank_input(a.input)
    else:
        documents, lines = read_documents(a.documents)
        queries = [RerankQuery(a.query, documents, a.documents, 0, lines)]
    reranker = pair_scorer_task(a.model, a.task_type).load_scorer(a.model, device=a.device, torch_dtype=a.torch_dtype)
    lines_out = rank_queries(reranker, queries, a.top_n, a.return_documents, a.batch_size, a.raw_scores)
    if a.output is None:
        for line in lines_out:
            print(dumps(line))
        return 0
    with replaced_when_done(a.output, "w", encoding="utf-8") as f:
        for line in lines_out:
            f.write(dumps(line) + "\n")
    print(f"wrote the rankings of {len(lines_out)} queries to {a.output}", file=sys.stderr)
    return 0


def _bool(s: str) -> bool:
    """true/false as ``mmembed sft``'s flags take them (transformers' parser)."""
    from transformers.hf_argparser import string_to_bool

    return string_to_bool(s)


def cmd_export(argv: list[str], environment: Environment | None = None) -> int:
    p = ArgumentParser(prog="mmembed export", allow_abbrev=False)
    p.add_argument("--adapters", "--ckpt_dir", dest="adapters", required=True, help="checkpoint folder")
    p.add_argument("--merge_lora", type=_bool, default=True)
    p.add_argument("--output_dir", default=None, help="default: CHECKPOINT-merged")
    a = p.parse_args(argv)
    if not a.merge_lora:
        raise UsageError("--merge_lora false: mmembed export writes a merged folder; pass --merge_lora true "
                         "(a checkpoint already is the adapter)")
    from ..model.embedding import check_model_folder

    check_model_folder(a.adapters, "--adapters")
    from .export import export_checkpoint

    out = export_checkpoint(a.adapters, a.output_dir, a.merge_lora)
    print(f"exported {a.adapters} -> {out}")
    return 0


def cmd_eval(argv: list[str], environment: Environment | None = None) -> int:
    p = ArgumentParser(prog="mmembed eval", allow_abbrev=False)
    p.add_argument("--model", required=True, help="checkpoint, exported folder or base model folder, or hub id (ORG/NAME)")
    p.add_argument("--sts", help="scored pairs (rows with query, response, label in [0, 1] or 0-5)")
    p.add_argument("--beir", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv")
    p.add_argument("--split", default="test", choices=["test", "dev", "train"], help="the qrels file of --beir")
    p.add_argument("--query_prefix", default="", help="plain text put before every --beir query")
    p.add_argument("--doc_prefix", default="", help="plain text put before every --beir document")
    p.add_argument("--json", "--output", dest="json", default=None, help="also write the metrics as JSON here")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--torch_dtype", default=None)
    add_hub_flags(p)
    a = p.parse_args(argv)
    if not a.sts and not a.beir:
        raise UsageError("pass --sts FILE and/or --beir FOLDER (neither was given)")
    check_model_flags(a, "--model", environment=environment)
    check_input_files(("--sts", a.sts))
    from ..data import SpecError
    from ..eval.beir import evaluate_beir, load_beir
    from ..model.embedder import Embedder

    beir = None
    if a.beir:  # read (and check) the folder before loading the model
        try:
            beir = load_beir(a.beir, a.split)
        except ValueError as e:
            raise SpecError(str(e)) from None  # the user's data: exit status 1
    from ..task import task_of_folder

    task = task_of_folder(a.model) if os.path.isdir(a.model) else None
    if task is not None and task.token_vectors:  # a late-interaction model: BEIR by MaxSim
        if a.sts:
            raise UsageError(f"--sts scores pairs by the cosine of one vector each; {a.model} is a late-interaction "
                             "model (a vector per token): evaluate it with --beir (ranked by MaxSim)")
        embedder = task.load_scorer(a.model, torch_dtype=a.torch_dtype)
    else:
        embedder = Embedder.from_pretrained(a.model, torch_dtype=a.torch_dtype)
    results: dict[str, dict] = {}
    if a.sts:
        from ..eval.sts import evaluate_pairs_file

        results["sts"] = evaluate_pairs_file(embedder, a.sts, batch_size=a.batch_size)
    if beir is not None:
        results["beir"] = evaluate_beir(
            embedder, beir, batch_size=a.batch_size, query_prefix=a.query_prefix, doc_prefix=a.doc_prefix
        )
    # one task: its metrics at the top level; both: {"sts": {...}, "beir": {...}}
    metrics = next(iter(results.values())) if len(results) == 1 else results
    text = json.dumps(metrics, indent=2)
    print(text)
    if a.json:
        from ..files import replaced_when_done

        with replaced_when_done(a.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


def cmd_mine(argv: list[str], environment: Environment | None = None) -> int:
    p = ArgumentParser(prog="mmembed mine", allow_abbrev=False,
                       description="Add hard negatives to a data file (see mmembed/tools/mining.py for the rules).")
    p.add_argument("--dataset", "--input", dest="dataset", required=True, help="rows in either ms-swift form")
    p.add_argument("--output", required=True, help=".jsonl or .json to write (rows in the form they were read)")
    p.add_argument("--model", default=None, help="dense mining with this model (default: BM25)")
    p.add_argument("--corpus", default=None, help="extra documents: .txt (one per line) or .jsonl rows with 'text'")
    p.add_argument("--num_negatives", type=int, default=3, help="at most this many new negatives per row")
    p.add_argument("--range_min", type=int, default=0, help="skip the range_min best candidates (rank 0 = best)")
    p.add_argument("--range_max", type=int, default=100, help="consider ranks < range_max only")
    p.add_argument("--margin", type=float, default=None, help="drop a candidate scoring > positive score - margin")
    p.add_argument("--relative_margin", type=float, default=None,
                   help="drop a candidate scoring > positive score * (1 - relative_margin)")
    p.add_argument("--guide_model", default=None, help="drop candidates this model scores >= the positive - guide_margin")
    p.add_argument("--guide_margin", type=float, default=0.0)
    p.add_argument("--teacher_reranker", default=None, help="a reranker whose scores become each row's teacher_scores")
    p.add_argument("--overwrite", type=_bool, nargs="?", const=True, default=False,
                   help="replace the rows' existing negatives (default: keep them first)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--torch_dtype", default=None)
    add_hub_flags(p)
    a = p.parse_args(argv)
    from .mining import MiningConfig, check_output_path, mine_file

    config = MiningConfig(
        num_negatives=a.num_negatives, range_min=a.range_min, range_max=a.range_max, margin=a.margin,
        relative_margin=a.relative_margin, guide_margin=a.guide_margin, overwrite=a.overwrite, batch_size=a.batch_size,
    )
    try:
        config.validate()
        check_output_path(a.output)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_model_flags(a, "--model", "--guide_model", "--teacher_reranker", environment=environment)
    check_input_files(("--dataset", a.dataset), ("--corpus", a.corpus))
    stats = mine_file(a.dataset, a.output, model=a.model, guide_model=a.guide_model, corpus=a.corpus,
                      config=config, torch_dtype=a.torch_dtype, teacher_reranker=a.teacher_reranker)
    print(stats.summary())
    print(f"wrote {stats.rows} rows to {a.output}")
    return 0


def cmd_serve(argv: list[str], environment: Environment | None = None) -> int:
    from ..hub import local_folder
    from .serve import parse_serve_args, serve

    config = parse_serve_args(argv)
    if config.served_model_name is None and local_folder(config.model) is None:
        config.served_model_name = config.model  # a hub id: the name clients know it by (not its snapshot folder's)
    check_model_flags(config, "--model", environment=environment)
    serve(config)
    return 0


COMMANDS = {"sft": cmd_sft, "train": cmd_sft, "embed": cmd_embed, "rerank": cmd_rerank, "export": cmd_export, "eval": cmd_eval, "mine": cmd_mine,
            "serve": cmd_serve}


def exit_code(error: BaseException) -> int | None:
    """The exit status an error ends a command with: 2 for a usage error (a flag, option or
    variable), 1 for the user's data or disk, None for anything else (a bug: its traceback)."""
    from ..data import DataError, SpecError
    from ..files import WriteError

    if isinstance(error, UsageError):
        return 2
    known = [DataError, SpecError, FileNotFoundError, FileExistsError, WriteError]
    # training's own, looked up only where training ran (importing them costs the Trainer's imports)
    for module, name in (("mmembed.training.guards", "NonFiniteLossError"),
                         ("mmembed.training.guards", "ZeroLossError"),
                         ("mmembed.training.checkpoints", "IncompleteCheckpointError")):
        if module in sys.modules:
            known.append(getattr(sys.modules[module], name))
    return 1 if isinstance(error, tuple(known)) else None


def _write_to_the_users_stderr(environment: Environment) -> None:
    """A process torchrun started for ``NPROC_PER_NODE`` writes its stderr (errors, logs,
    progress) to the user's, which the relaunching process named, rather than to torchrun's
    (a log file of torchrun's own report). Where that cannot be opened, it stays as it is."""
    target = environment.launch.mmembed_worker_stderr
    if not target or not environment.launch.launched:
        return
    try:
        stream = open(target, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open for the process
    except OSError:
        return
    sys.stderr.flush()
    os.dup2(stream.fileno(), sys.stderr.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"mmembed: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    environment = read_environment()  # every variable the command follows, read once here
    _write_to_the_users_stderr(environment)
    try:
        rest, debug = take_debug(rest, environment.debug)
    except UsageError as e:  # a bad MMEMBED_DEBUG
        print(f"mmembed {command}: error: {e}", file=sys.stderr)
        return 2
    if debug and not environment.debug:  # --debug true: the processes torchrun starts show theirs too
        environment = environment.with_values(MMEMBED_DEBUG="1")
    _setup_logging(environment)
    from ..training.device_flags import import_deepspeed_only_when_used

    import_deepspeed_only_when_used()  # every command: DeepSpeed imported (and its CPU line printed) only when used
    try:
        return COMMANDS[command](rest, environment)
    except KeyboardInterrupt:  # Ctrl-C: what was written whole stays (checkpoints, outputs are renamed when done)
        if debug:
            raise
        print(f"mmembed {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as e:
        code = exit_code(e)
        if code is None or debug:
            raise
        print(f"mmembed {command}: error: {one_line(e)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
