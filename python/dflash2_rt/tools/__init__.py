"""Small command-line tools (``python -m dflash2_rt.tools.<name>``)."""
