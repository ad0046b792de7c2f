"""The tasks, one package (or module) each: :mod:`~mmembed.tasks.embedding`,
:mod:`~mmembed.tasks.reranker` (``reranker`` and ``generative_reranker``) and
:mod:`~mmembed.tasks.late_interaction`. Each supplies a :class:`mmembed.task.Task`; the shared
code finds it by name through :func:`mmembed.task.get_task` and never imports these packages.
"""
