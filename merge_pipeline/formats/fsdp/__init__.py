"""verl FSDP rank files (``--backend fsdp``): ``reader`` plans them; ``rank_template`` and
``archive_layouts`` check and locate the rank files that repeat a verified one, by bytes."""
