"""The Celery configuration shared by the API (which sends tasks by name) and the workers: Redis broker, JSON only, one job per worker slot, results as artifacts.

Rules (see "Lessons from the peers" in PRODUCT.md):

* JSON is the only serializer accepted anywhere: no pickle crosses the broker.
* ``task_acks_late`` + prefetch 1: a message is acknowledged when its job ends, and a worker
  holds one job at a time, so a dead worker's job is not silently lost with its prefetch.
* The broker's ``visibility_timeout`` is above the longest job, so Redis does not hand a
  running job to a second worker.
* No result backend: tasks return nothing; outputs are artifacts, state is the SQL job row.
* Queues: ``gpu`` for long model work (profile, convert, evaluate, fine-tune, export), ``cpu`` for
  light work that a person waits for (inspect a model, build a calibration set, probes): ``moelab serve``
  runs a worker on ``cpu`` alone beside the others, so light work never waits behind a conversion.
  Task id = job id.
* Pool ``solo`` (default) or ``threads``: never forked children, which cannot use CUDA.

``celery -A workers.celery_app worker -Q gpu,cpu`` runs a worker (that module adds the tasks);
the API sends tasks by name through :func:`make_celery` without importing them (nor torch).
"""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from moelab.settings import Settings

GPU_QUEUE = "gpu"
CPU_QUEUE = "cpu"
#: node names of workers on the light queue alone (``-Q cpu``): they take no share of a conversion's layers
LIGHT_WORKER_PREFIX = "moelab-light@"

#: job kind -> (Celery task name, queue)
TASKS: dict[str, tuple[str, str]] = {
    "inspect_model": ("moelab.inspect_model", CPU_QUEUE),
    "build_calibration": ("moelab.build_calibration", CPU_QUEUE),
    "profile": ("moelab.profile", GPU_QUEUE),
    "conversion": ("moelab.convert", GPU_QUEUE),
    "evaluation": ("moelab.evaluate", GPU_QUEUE),
    "finetune": ("moelab.finetune", GPU_QUEUE),
    "probe": ("moelab.probe", CPU_QUEUE),  # one text through a model: seconds, while someone waits
    "activation_probe": ("moelab.activation_probe", CPU_QUEUE),
    "export": ("moelab.export", GPU_QUEUE),  # loads the whole converted model: model work
}

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def broker_url(settings: Settings) -> str:
    return settings.redis_url or DEFAULT_REDIS_URL


def make_celery(settings: Settings, include: tuple[str, ...] = ()) -> Celery:
    """``include``: task modules the app imports when a worker starts (none for the API)."""
    app = Celery("moelab", broker=broker_url(settings), include=list(include))
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_acks_on_failure_or_timeout=True,
        task_reject_on_worker_lost=False,
        worker_prefetch_multiplier=1,
        worker_pool=settings.worker_pool,
        worker_concurrency=settings.worker_concurrency if settings.worker_pool == "threads" else 1,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_enable_remote_control=True,  # revoke reaches workers over the broker
        task_queues=tuple(Queue(q, Exchange(q, type="direct"), routing_key=q) for q in (GPU_QUEUE, CPU_QUEUE)),
        task_default_queue=CPU_QUEUE,
        task_default_exchange=CPU_QUEUE,
        task_default_routing_key=CPU_QUEUE,
        task_routes={name: {"queue": queue, "exchange": queue, "routing_key": queue} for name, queue in TASKS.values()},
        task_create_missing_queues=False,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "global_keyprefix": settings.redis_prefix,
            "socket_timeout": 10,
            "socket_connect_timeout": 5,
        },
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        broker_pool_limit=4,
    )
    return app


def send_job(app: Celery, job_id: str, kind: str) -> None:
    """Send a job of ``kind`` (its id is the task id and the only argument): the one place tasks are
    sent, by the API (new jobs) and by the workers' re-queue sweep (jobs the broker lost).

    The queues are declared first, every time (a few SADDs on a fresh connection): a Redis that
    restarted empty would otherwise swallow the message until a worker reconnects and re-declares.
    """
    name, queue = TASKS[kind]
    declare_queues(app)
    app.send_task(name, args=[job_id], task_id=job_id, queue=queue)


def declare_queues(app: Celery) -> None:
    """(Re)create the queues and their bindings: after a Redis restart without persistence they are
    gone, and kombu drops a message sent to an exchange with no bound queue without an error.

    A fresh connection, on purpose: kombu remembers declarations per connection, and Celery's
    producer pool (process-wide, keyed by broker URL) keeps its connection across a Redis restart,
    so sending through it never declares again.
    """
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in app.conf.task_queues:
            queue.bind(channel).declare()
