"""Measurement: what a trial reads off the device, the host and the model, and nothing it decides.

    bench        per-step CUDA-event (CPU: perf_counter) timing, launch-bound detection
    metrics      FLOPs per step (closed form for MiniGPT, FlopCounterMode elsewhere), FP8 FLOP share, MFU, stats
    kernels      the profiled step's kernels, classed (GEMM BF16/FP8, attention, element-wise, ...)
    energy       board energy and power over a window of repeated steps (NVML)
    nvml         the NVML handle and its reads (clocks, power limit, processes)
    memory       allocator, NVML and host peaks of one trial
    memory_plan  the plan of one rank's memory from the module run under fake tensors (the dry run, the record)
    disturbance  what else used the CPU or GPU while the steps were timed
    fp8_layers   per-layer FP8 reads after training: SQNR forward/backward, cast health, outliers
    fp8_floors   their floors and names (torch-free: the report reads them)
    fingerprint  host, GPU, driver and library versions, code revision

May import: torch, ``trials.spec``, ``trials.models`` and ``trials.backends`` (their tables and seams),
``trials.parallel`` (which rank measures) and each other, and from ``trials.workloads`` only the data
(``data``, ``teacher_forced``'s held batch) and the loss (``loss``), never a workload. Never Ray or ``orchestrator``.
"""
