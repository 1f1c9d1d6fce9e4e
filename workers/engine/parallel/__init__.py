"""Tensor parallelism inside a device group: rank 0 (the worker process) drives one
spawned rank process per extra device; see `driver.TensorParallelRunner`."""

from workers.engine.parallel.driver import TensorParallelError, TensorParallelRunner
from workers.engine.parallel.factory import make_tp_runner

__all__ = ["TensorParallelError", "TensorParallelRunner", "make_tp_runner"]
