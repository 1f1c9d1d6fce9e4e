"""Errors the engine tells apart."""


class DeviceGroupError(RuntimeError):
    """The device group itself cannot run another step (a lost tensor-parallel rank, a
    broken device). No request is to blame, so the engine does not look for a culprit: the
    step's exception reaches the caller, which ends or hands back every job."""
