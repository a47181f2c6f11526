"""kaitian's user-facing errors: one root, one class per kind of mistake.

Every error a user can cause (bad input, a missing engine or image, a config
that cannot be read) derives from :class:`KaitianError`, so the command-line
tools print it as one line and exit non-zero; anything else is a bug and keeps
its traceback. Each class also derives from the stdlib error it refines, so
``except ValueError`` keeps working.

Errors raised inside a collective are torch's ``DistBackendError`` (from the
C++ backend), as for every other backend.
"""

from __future__ import annotations

__all__ = [
    "KaitianError",
    "SettingError",
    "UnknownVendorError",
    "DeviceSelectionError",
    "NodeWorkersError",
    "UsageError",
    "SplitError",
    "TrainingError",
    "ElasticError",
    "CapabilityConfigError",
    "BackendSetupError",
    "LayoutError",
    "RendezvousError",
    "VersionMismatchError",
    "QuotaUnavailableError",
    "RunDirError",
    "DockerRuntimeError",
    "DockerOptionError",
    "DockerUnavailableError",
    "ImageNotFoundError",
    "ContainerLookupError",
    "ImageBuildError",
]


class KaitianError(Exception):
    """Root of every user-facing kaitian error; its message says what to do."""


# --- settings and devices ------------------------------------------------------


class SettingError(KaitianError, ValueError):
    """A ``KAITIAN_*`` variable with a value that cannot be used."""


class UnknownVendorError(KaitianError, ValueError):
    """A device type that is not in the vendor table."""


class DeviceSelectionError(KaitianError, ValueError):
    """A ``USE_<VENDOR>`` / ``--devices`` / ``--cpu-slots`` value that cannot be honoured."""


# --- the launcher ----------------------------------------------------------------


class UsageError(KaitianError, ValueError):
    """A kaitianrun command line that torchrun's config builder refuses."""


class NodeWorkersError(KaitianError, ValueError):
    """Flags that cannot be turned into this node's workers (``--cpu-groups``, ``--cpu-quota``)."""


class RunDirError(KaitianError, PermissionError):
    """The node's run directory cannot be made private to this user."""


class QuotaUnavailableError(KaitianError, PermissionError):
    """``--cpu-quota`` cannot be enforced on this host."""


# --- training --------------------------------------------------------------------


class SplitError(KaitianError, ValueError):
    """The global batch cannot be split as asked (caps, sizes)."""


class TrainingError(KaitianError, RuntimeError):
    """Ranks disagree during training (steps, batches) or a DDP feature kaitian cannot keep exact."""


class CapabilityConfigError(KaitianError, RuntimeError):
    """The capability config cannot be read or written."""


# --- the backend -----------------------------------------------------------------


class BackendSetupError(KaitianError, RuntimeError):
    """The kaitian process group cannot be built in this environment."""


class LayoutError(KaitianError, RuntimeError):
    """Ranks disagree on the group layout, or a rank's group cannot be determined."""


class ElasticError(TrainingError):
    """A job under ``--on-failure continue`` cannot go on after a loss (the message says why)."""


# --- the launcher across nodes ---------------------------------------------------


class RendezvousError(KaitianError, RuntimeError):
    """The nodes of a rendezvous round cannot form one job (the message says why)."""


class VersionMismatchError(RendezvousError):
    """Nodes (or an agent and its workers) run different kaitian or bridge protocol versions."""


# --- docker ----------------------------------------------------------------------


class DockerRuntimeError(KaitianError, RuntimeError):
    """The docker runtime cannot do what was asked; the message says what to fix."""


class DockerOptionError(DockerRuntimeError, ValueError):
    """A docker runtime option (``--image``, ``-v``, ``--shm-size``) is malformed."""


class DockerUnavailableError(DockerRuntimeError):
    """No Docker engine answers, or the SDK is missing."""


class ImageNotFoundError(DockerRuntimeError):
    """A container image is not on this host."""


class ContainerLookupError(DockerRuntimeError):
    """Zero or several containers match where exactly one must."""


class ImageBuildError(DockerRuntimeError):
    """A ``kaitian images build`` step failed."""
