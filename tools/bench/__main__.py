import sys

from graphddp.bench.cli import main

sys.exit(main())
