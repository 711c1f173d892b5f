"""What a model argument names, checked before anything starts.

``CacheRuntime(model=...)`` takes a local model directory or a Hugging Face
repo id. :func:`check_model_source` reads a local directory's files (no MLX,
no weights loaded) and says what is wrong in one :class:`ModelLoadError`
naming the path; a string that is not a local path but has the shape of a
repo id (``org/name``) is left to the loader, which may download it where the
machine can. A load that still fails is reported as the same error.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

import attrs

from mlxkv.cache.errors import CacheError

__all__ = ["ModelLoadError", "ModelSource", "check_model_source"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(CacheError):
    """The model cannot be loaded.

    Attributes:
        path: the model argument as given.
        reason: what is wrong, in words (the message shows its first line).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        # One line: a loader's own message can run to several (a hub
        # error's advice); the whole of it stays in ``reason``.
        first = reason.strip().splitlines()[0] if reason.strip() else reason
        super().__init__(f"cannot load the model {path!r}: {first}")


@attrs.frozen(kw_only=True)
class ModelSource:
    """A checked model argument.

    Attributes:
        path: the directory (or repo id) to load.
        kind: ``"text"`` (an mlx-lm model), ``"vision"`` (a vision-language
            model, loaded with mlx-vlm) or ``"hub"`` (a repo id, not local:
            the loader decides).
        model_type: the config's ``model_type`` (``None`` for a repo id).
    """

    path: str
    kind: Literal["text", "vision", "hub"]
    model_type: str | None = None


def check_model_source(model: str) -> ModelSource:
    """Check that ``model`` names something a loader can take.

    Args:
        model: a model directory or a Hugging Face repo id.

    Returns:
        What it is.

    Raises:
        ModelLoadError: a local path that is not a model directory (missing,
            not a directory, no or unreadable ``config.json``, no
            ``model_type``, no ``*.safetensors`` weights, no tokenizer), or a
            string that is neither a path nor a repo id.
    """
    path = Path(os.path.expanduser(model))
    if not path.exists():
        if _REPO_ID.match(model) and not model.startswith((".", "/", "~")):
            return ModelSource(path=model, kind="hub")
        raise ModelLoadError(model, "no such directory (and not a Hugging Face repo id)")
    if not path.is_dir():
        raise ModelLoadError(model, "is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(model, "has no config.json: not an mlx-lm model directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(model, f"config.json cannot be read: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(model, "config.json has no model_type")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(model, "has no *.safetensors weights")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ModelLoadError(model, "has no tokenizer (tokenizer.json or tokenizer.model)")
    kind: Literal["text", "vision"] = "vision" if "vision_config" in config else "text"
    return ModelSource(path=str(path), kind=kind, model_type=config["model_type"])
