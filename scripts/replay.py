"""`python scripts/replay.py ...` is `kvmem-replay ...` (see kvmem/replay/cli.py)."""
import sys

from kvmem.replay.cli import main

sys.exit(main())
