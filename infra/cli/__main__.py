"""``python -m infra.cli``: the ``mopflow`` command."""

import sys

from infra.cli.parser import main

sys.exit(main())
