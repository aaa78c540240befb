"""The ``kinetic-local`` worker (``worker``): jobs as local processes in hash-keyed uv environments, and
its warm runners (``warm``). Nothing is imported here, so a sibling module loads without the worker."""
