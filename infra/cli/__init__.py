"""The ``mopflow`` command: the operator's entry point (the face of ``infra``).

- :mod:`~infra.cli.parser`: the command line and ``main`` (the console script);
- :mod:`~infra.cli.run` and :mod:`~infra.cli.pipeline`: ``mopflow run`` (the retraining DAG once
  through ``dag.test()``, stopped and resumed) and ``mopflow runs``;
- :mod:`~infra.cli.registry`: ``serve``, ``promote`` and ``rollback`` of the champion;
- :mod:`~infra.cli.stack_commands`: ``up``, ``down`` and ``status`` of the local stack;
- :mod:`~infra.cli.spot`: ``plan-spot``; :mod:`~infra.cli.info`: ``settings``, ``config-keys``,
  ``dashboard``.
"""

from infra.cli.errors import CliError
from infra.cli.parser import build_parser, main

__all__ = ["CliError", "build_parser", "main"]
