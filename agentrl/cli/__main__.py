"""``python -m agentrl.cli``: the ``agentrl`` command (torchrun and scripts start it this way)."""

import sys

from agentrl.cli import main

sys.exit(main())
