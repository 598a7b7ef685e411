"""The process group and the state of a step: StepState, dispatch, agreement, union average, join, calibration."""
