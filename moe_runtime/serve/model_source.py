"""Where a served model (or tokenizer) comes from: a local folder, or a hub id already in the cache.

Resolution order, for the value given to ``serve MODEL`` / ``--model`` / ``--tokenizer``:

1. a local folder of that path: used as it is (a model folder must hold ``config.json``);
2. a path that exists but is no folder, or that is written as a path (absolute, ``./``, ``~``):
   an error naming the path, without importing anything heavy;
3. a Hugging Face hub id (``name`` or ``org/name``, optionally ``@revision``): the snapshot already
   in the local Hugging Face cache, found with ``huggingface_hub``'s cache-only lookup. Nothing is
   ever downloaded at run time; an id that is not cached is an error naming it and the cache.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


class SourceError(ValueError):
    """The model or tokenizer cannot be found; the message names it and what is accepted."""


def _looks_like_a_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (
        os.sep != "/" and os.sep in spec)


def config_link_problem(config: Path) -> str | None:
    """Why ``config`` (a folder's config.json) cannot be read as a file although a name is there,
    as ``moe-runtime check`` words it: a symbolic link loop, a link to nothing, a directory; or
    ``None`` (a file, or no such name at all: "no config.json")."""
    if config.is_file():
        return None
    if config.is_dir():
        return f"{config} is a directory, not a file; accepted: config.json as a JSON file"
    if not config.is_symlink():
        return None
    try:
        with config.open("rb"):
            pass
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # exists() is False for a loop as for a dangling link
            return (f"{config} is a symbolic link loop (a link to {config.readlink()}: following "
                    "the links never reaches a file); accepted: config.json as a file, or a link "
                    "to one")
        if not config.exists():
            return (f"{config} is a link to {config.readlink()}, which does not exist; accepted: "
                    "config.json as a file, or a link to one")
        return f"{config} cannot be read ({exc.strerror or type(exc).__name__})"
    return None


def _require_config(folder: Path, shown: str, what: str) -> None:
    config = folder / "config.json"
    problem = config_link_problem(config)
    if problem is not None:
        raise SourceError(f"{what} {shown} is not a model folder: {problem}")
    if not config.is_file():
        raise SourceError(f"{what} {shown} is not a model folder: it has no config.json")


def resolve_source(spec: str, *, what: str = "model", need_config: bool = True) -> Path:
    """The local folder for ``spec`` (see the module's resolution order)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if need_config:
            _require_config(path, spec, what)
        return path
    if path.exists():
        raise SourceError(f"{what} {spec} is a file; give a checkpoint folder or a Hugging Face "
                          "hub id (org/name)")
    repo, _, revision = spec.partition("@")
    if _looks_like_a_path(spec) or not _HUB_ID.match(repo):
        raise SourceError(f"{what} {spec}: no such folder, so no config.json; give a local "
                          "checkpoint folder or the id of a Hugging Face hub model already in "
                          "the local cache (org/name)")
    return _cached_snapshot(repo, revision or None, what=what, need_config=need_config)


def _cached_snapshot(repo: str, revision: str | None, *, what: str, need_config: bool) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise SourceError(f"{what} {repo}: not a local folder, and huggingface_hub (which finds "
                          "cached hub models) is not installed") from None
    cache = constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or a malformed cache entry
        shown = f"{repo}@{revision}" if revision else repo
        raise SourceError(
            f"{what} {shown}: not a local folder, and the Hugging Face hub id {shown!r} is not in "
            f"the local cache ({cache}); moe-runtime serve never downloads: fetch it first "
            f"(hf download {repo}) or give a local folder. ({type(exc).__name__})") from None
    if need_config:
        problem = config_link_problem(folder / "config.json")
        if problem is not None:
            raise SourceError(f"{what} {repo}: the cached snapshot is not a model folder: "
                              f"{problem}")
        if not (folder / "config.json").is_file():
            raise SourceError(f"{what} {repo}: the cached snapshot {folder} has no config.json")
    return folder
