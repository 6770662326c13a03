import sys

from cb_kernels.cli import main

sys.exit(main())
