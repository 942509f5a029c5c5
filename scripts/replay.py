"""`python scripts/replay.py ...` is `kvmem-replay ...` (see kvmem/replay/cli.py)."""
import sys

from kvmem.replay.cli import main

if __name__ == "__main__":  # not in the worker processes --compare-policies and --sweep start: "spawn" runs this file
    sys.exit(main())
