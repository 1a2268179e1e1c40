"""moelab workers: the Celery app and its tasks (thin), and ``moelab.engine``, the pure ML library."""
