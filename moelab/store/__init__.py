"""What the API (``backend``) and the workers (``workers``) share: the SQL store of jobs and
resources (``db``, ``jobs``), the artifacts directory (``artifacts``), the broker's Celery
configuration and task names (``broker``), worker presence and death (``liveness``) and the
re-sending of queued jobs the broker lost (``requeue``).

``backend`` and ``workers`` both import this package and never each other; both may import the
pure ML library ``moelab.engine``, which imports neither.
"""
