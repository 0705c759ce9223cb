import sys

from hf_dist.cli.main import main

sys.exit(main())
