"""`python -m sglang.review`: see sglang.review.cli."""

import sys

from sglang.review.cli import main

if __name__ == "__main__":
    sys.exit(main())
