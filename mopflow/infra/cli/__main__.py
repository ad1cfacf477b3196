"""``python -m mopflow.infra.cli``: the ``mopflow`` command."""

import sys

from mopflow.infra.cli.parser import main

sys.exit(main())
