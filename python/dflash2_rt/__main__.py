"""``python -m dflash2_rt``: the dflash2-rt command line."""
from .cli import main

raise SystemExit(main())
