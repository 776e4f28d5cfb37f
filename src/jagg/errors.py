"""The errors a run reports to its user, in one leaf module (it imports nothing from ``jagg``).

Each is raised by the layer that detects it and caught by the CLI (``jagg.train``), which prints its message
as one line and exits with status 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the allowed values."""


def require(ok: bool, msg: str) -> None:
    """``ConfigError(msg)`` unless ``ok``: one config check (every section's ``validate`` writes them so)."""
    if not ok:
        raise ConfigError(msg)


class ArtefactError(RuntimeError):
    """A cached world artefact is missing or does not match the code's configuration."""


class WeightsUnavailableError(RuntimeError):
    """Requested weights (or data) are neither a local path nor in the hub cache, and cannot be fetched."""


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or corrupt; the message names the file and what to do."""


# the CLI prints each as one line, exit 2
USER_ERRORS = (ConfigError, ArtefactError, WeightsUnavailableError, CheckpointError)


def os_error_line(err: OSError) -> str:
    """One line for an ``OSError`` the CLI did not expect by name: the path(s), what the system said and the
    errno's name (``cannot use /dev/null/x: Not a directory [ENOTDIR]``)."""
    import errno

    paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None) or "a file"
    name = errno.errorcode.get(err.errno or 0, f"errno {err.errno}")
    return f"cannot use {paths}: {err.strerror or err} [{name}]"
