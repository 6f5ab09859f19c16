"""``python -m trainer.run --config resolved.yaml [section.key=value ...]`` (see trainer.run.entry)."""

import sys

from trainer.run.entry import main

sys.exit(main())
