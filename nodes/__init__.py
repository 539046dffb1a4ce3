"""The pack's package: one folder per feature (``pe``, ``dit``, ``text``, ``accel``)."""
