import sys

from merge_pipeline.cli import main

sys.exit(main())
