import sys

from mxrefit.cli import main

sys.exit(main())
