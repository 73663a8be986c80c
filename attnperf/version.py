"""The package's version, and the torch releases its test suite ran on."""

import warnings

__version__ = "0.1.0"

# The torch releases (major.minor) the whole test suite passed on; pyproject admits older
# and newer ones, which get `torch_warning` at import.
TESTED_TORCH = ("2.13", "2.14", "2.15")


def torch_warning(version: str) -> str | None:
    """Why a torch of `version` ("2.15.0+cpu") is outside the tested range, else None."""
    if ".".join(version.split("+")[0].split(".")[:2]) in TESTED_TORCH:
        return None
    return (f"attnperf {__version__} is tested with torch {', '.join(TESTED_TORCH)}; "
            f"torch {version} may work, but is not tested")  # fmt: skip


def warn_on_untested_torch(version: str) -> None:
    reason = torch_warning(version)
    if reason is not None:
        warnings.warn(reason, stacklevel=2)
