"""The Celery side of a device-group worker: the `generate` task and the bootstep that
starts and drains the group's runtime.

Celery task threads run only the short `generate` body (claim, wait for room, hand over);
generation runs in the batcher thread. The bootstep ties the runtime to the worker's
life: it starts after the task pool and stops before it, and the consumer (started last,
stopped first) fetches nothing once the drain begins.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps

from tasks.protocol import GENERATE_TASK
from tasks.settings import Settings
from workers.runtime import GroupRuntime

CLAIM_RETRY_SECONDS = 2.0  # a claim that failed on Postgres is retried this much later


def make_group_step(runtime: GroupRuntime) -> type[bootsteps.StartStopStep]:
    """A worker bootstep owning `runtime`: started after the pool, stopped before it."""

    class DeviceGroupStep(bootsteps.StartStopStep):
        # NOTE: after the Pool so it stops BEFORE the pool joins its task threads (a task
        # blocked in admission is released by our stop); the Consumer starts last and
        # stops first, so no message is fetched once the drain begins.
        requires = ("celery.worker.components:Pool",)
        label = "llmq device group"

        def create(self, worker: Any) -> GroupRuntime:
            return runtime

    return DeviceGroupStep


def build_app(settings: Settings, runtime: GroupRuntime) -> Celery:
    """Register `generate` on `runtime.app`, bound to `runtime`, and add the bootstep."""
    app = runtime.app

    from workers.admission import AdmissionRetry

    @app.task(name=GENERATE_TASK, bind=True, ignore_result=True, max_retries=None)
    def generate(task: Any, job_id: str) -> str:
        try:
            return runtime.generate(job_id)
        except AdmissionRetry as exc:
            raise task.retry(countdown=CLAIM_RETRY_SECONDS, exc=exc) from None

    app.steps["worker"].add(make_group_step(runtime))
    return app

