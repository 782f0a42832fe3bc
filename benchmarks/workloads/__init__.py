"""Workloads for the benchmarks and the tests, outside the installed package: third-party architectures at tiny
sizes (`thirdparty`), the zoo GPT with every module renamed (`renamed`), the model sweep (`sweep`) and the cost
model's calibration against XLA (`calibrate`). Import them with the checkout's root on `sys.path`."""
