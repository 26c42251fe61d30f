"""Object stores (``s3://``, ``gs://``, any fsspec URL): URLs, backends, objects read as input files, views,
listings, the lock across machines, and publishing."""
