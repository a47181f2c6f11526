"""``python -m kaitian``: the ``kaitian`` command."""

import sys

from kaitian.commands import main

sys.exit(main())
