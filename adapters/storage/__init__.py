"""On-disk stores written atomically: calibration, converted-model cache, prefix spill."""
