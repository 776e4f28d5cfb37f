"""The errors a run reports to its user, in one leaf module (it imports nothing from ``jagg``).

Each is raised by the layer that detects it and caught by the CLI (``jagg.train``), which prints its message
as one line and exits with status 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the allowed values."""


class ArtefactError(RuntimeError):
    """A cached world artefact is missing or does not match the code's configuration."""


class WeightsUnavailableError(RuntimeError):
    """Requested weights (or data) are neither a local path nor in the hub cache, and cannot be fetched."""


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or corrupt; the message names the file and what to do."""
