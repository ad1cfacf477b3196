"""The pipeline's stages, one function per Airflow task: start, shard, search, ensemble, distill,
register, finalize.

This is the layer that joins ``training`` and ``compression`` into the pipeline; the DAG files
and ``mopflow run`` call it, and nothing below it imports it. Every stage runs inside one
:func:`~mopflow.pipeline.context.stage` context (the config parsed once, the stage's MLflow run owned
through the ``Tracker``, lineage tags, peak memory, the root cause recorded on failure), takes
the typed records its upstream stages returned and returns its own
(:mod:`mopflow.pipeline.records`; XCom carries them as small dicts). Every path a run writes is
named in :mod:`mopflow.pipeline.paths`. Every stage is idempotent: outputs are keyed by content
hash or by the pipeline run key.

The DAG tasks import their stage function from its module inside the task body: the stages'
own imports (torch, MLflow) are heavy, and Airflow parses the DAG files often.
"""
