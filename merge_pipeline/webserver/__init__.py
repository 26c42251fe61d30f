"""A running Dagster webserver, asked from the command line over its GraphQL API (``client``): a merge put
in its run queue (``queue``, for ``merge-pipeline queue``). Plain HTTP: nothing here imports dagster.
"""
