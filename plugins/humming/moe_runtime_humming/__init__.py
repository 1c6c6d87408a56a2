"""moe-runtime-humming: NVFP4 experts through Humming's indexed grouped GEMMs (compute capability 9.0).

Importing this package imports neither humming nor torch; the backend class lives in
``moe_runtime_humming.backend`` and is loaded only when the planner selects it.
"""

__version__ = "0.1.0"
