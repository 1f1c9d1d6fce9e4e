"""Errors the engine tells apart."""


class StepInterrupted(Exception):
    """The model stopped a step between two layers because the engine's `step_yield`
    asked it to (a foreground request arrived during a background-only step). Nothing of
    the step counts: the engine schedules its chunks again."""


class DeviceGroupError(RuntimeError):
    """The device group itself cannot run another step (a lost tensor-parallel rank, a
    broken device). No request is to blame, so the engine does not look for a culprit: the
    step's exception reaches the caller, which ends or hands back every job."""
