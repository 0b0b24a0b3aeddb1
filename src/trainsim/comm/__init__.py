"""Communication: collective measurements, the NCCL cost model and its calibration."""
