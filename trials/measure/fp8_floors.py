"""What the per-layer FP8 reads (trials/measure/fp8_layers.py) read and the floors a layer is judged by; no torch here,
so the report (orchestrator/report/numerics.py) reads it on a host without torch's import cost.

The floors: torchao's own Float8Linear test (pytorch/ao test/float8/test_base.py,
``TestFloat8Linear._test_linear_impl``) holds a float8 Linear's output to ``sqnr >= 18.0`` dB and its weight
gradient to ``>= 17.0`` dB against the high-precision Linear on the same input. The input gradient is held to
the gradient's floor. A layer under them loses more than torchao accepts of its own layers on random data.
"""

from __future__ import annotations

OPERANDS = ("act", "weight", "grad")  # the GEMM's input, its weight, the gradient of its output
DIRECTIONS = ("fwd", "dgrad", "wgrad")  # the output, the input gradient, the weight gradient
SQNR_FLOOR_DB = {"fwd": 18.0, "dgrad": 17.0, "wgrad": 17.0}
