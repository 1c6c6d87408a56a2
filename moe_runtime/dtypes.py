"""The model's activation dtypes by name: the one table of names, aliases and sizes.

A checkpoint's ``config.json`` names its dtype (``torch_dtype`` / ``dtype``: ``"bfloat16"``,
``"float16"``, ``"float32"``, sometimes ``"half"`` or ``"torch.bfloat16"``); layer problems,
loading and the memory estimate all read it through :func:`config_dtype` and
:func:`model_dtype_name`.
"""

from __future__ import annotations

#: canonical name -> bytes per element
MODEL_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
_ALIASES = {"half": "float16", "float": "float32"}


def config_dtype(config: dict, default: str = "bfloat16"):
    """The dtype a ``config.json`` (``config``) names, as written: ``dtype``, then ``torch_dtype``,
    at its top level, then in its ``text_config``; ``default`` where none is set."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for table in (config, text_config):
        for key in ("dtype", "torch_dtype"):
            if table.get(key):
                return table[key]
    return default


def model_dtype_name(value, default: str | None = "bfloat16") -> str | None:
    """The canonical name of ``value`` (a name, an alias, ``"torch.X"`` or a torch dtype), or
    ``default`` when it is empty or not a model dtype."""
    if value is None or value == "":
        return default
    name = str(value).replace("torch.", "")
    name = _ALIASES.get(name, name)
    return name if name in MODEL_DTYPES else default


def torch_dtype(name: str):
    """The torch dtype of a canonical model dtype name."""
    import torch

    return getattr(torch, name)
