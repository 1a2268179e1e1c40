"""The workers' Celery app: the shared configuration (``moelab.store.broker``) plus the tasks.

``celery -A workers.celery_app worker -Q gpu,cpu -P solo`` starts a worker.
"""

from __future__ import annotations

from moelab.settings import get_settings
from moelab.store.broker import make_celery

app = make_celery(get_settings(), include=("workers.tasks",))
