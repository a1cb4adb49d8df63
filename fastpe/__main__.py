import sys

from fastpe.cli import main

sys.exit(main())
