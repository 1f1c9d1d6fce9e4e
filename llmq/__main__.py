"""`python -m llmq ...` is the `llmq` command."""

import sys

from llmq.cli import main

sys.exit(main())
