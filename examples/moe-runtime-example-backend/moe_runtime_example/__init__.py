"""moe-runtime-example-backend: a pure-torch BF16/FP16 experts backend for moe-runtime.

Importing the package imports nothing heavy: the declaration is in ``plugin``, the backend class in
``experts``, which moe-runtime imports only when the planner selects the backend.
"""

__version__ = "0.1.0"
