"""What this package adds to a Dagster instance (``dagster.yaml``), beside the definitions in ``defs``."""
