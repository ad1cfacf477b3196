"""The ``mopflow`` command: the operator's entry point (the face of ``infra``).

- :mod:`~mopflow.infra.cli.parser`: the command line and ``main`` (the console script);
- :mod:`~mopflow.infra.cli.run` and :mod:`~mopflow.infra.cli.pipeline`: ``mopflow run`` (the retraining DAG once
  through ``dag.test()``, stopped and resumed) and ``mopflow runs``;
- :mod:`~mopflow.infra.cli.registry`: ``serve``, ``promote`` and ``rollback`` of the champion;
- :mod:`~mopflow.infra.cli.stack_commands`: ``up``, ``down`` and ``status`` of the local stack;
- :mod:`~mopflow.infra.cli.spot`: ``plan-spot``; :mod:`~mopflow.infra.cli.info`: ``settings``, ``config-keys``,
  ``dashboard``.
"""

from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.parser import build_parser, main

__all__ = ["CliError", "build_parser", "main"]
